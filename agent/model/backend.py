"""Backend: which kernels a model runs on, chosen once at load; it builds the decoder's parts
(agent.model.norms' norms and collectives, agent.model.linear's projections, agent.model.attention's attention), so
agent.model.decoder composes them and has no dtype branches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import mindspore as ms
from mindspore import nn

from agent.model.attention import NativeAttention, PlainAttention
from agent.kernels import custom_ops
from agent.model.params import DTYPES, KV_DTYPES, WEIGHT_BLOCK, param
from agent.model.collectives import Alone, CommCollectives, ShmCollectives
from agent.model.norms import NativeNorms, PlainNorms
from agent.model.linear import LAYER_KINDS, Bf16Linear, F16Linear, F32Linear, Int8Linear, LayerWeights, PlainF16Linear, PlainLinear, Projection
from agent.model.embedding import BlockEmbedding, TableEmbedding, embedding_scale
from agent.model.fusion import embedding, fp32_projections, gguf_projections, int8_projections, lm_head
from agent.model.linear_gguf import GgufLinear
from agent.model_config import ModelConfig
from common.config import QUANT_GROUP_SIZE

if TYPE_CHECKING:
    from agent.model.lora import LoraSlots

PLAIN_DTYPES = ("float32", "float16")  # of weights and KV cache on the plain-MindSpore path (any device)


@dataclass(frozen=True)
class Backend:
    """Which kernels a model runs on: `dtype` (float32 | bfloat16 | float16 | int8) of the projections
    and LM head, `lib` the native kernel library (None: plain MindSpore ops, PLAIN_DTYPES only)."""

    dtype: str = "float32"
    lib: str | None = None
    kv_dtype: str = "float32"  # the KV cache's (KV_DTYPES); the plain path keeps float32 or float16
    int8_group: int = QUANT_GROUP_SIZE
    ranges: dict[str, list[np.ndarray]] | None = None  # agent.model.calibrate's activation ranges (int8)
    tp_size: int = 1  # tensor-parallel ranks: this model is one rank's shard (agent.tensor_parallel)
    lora: LoraSlots | None = None  # the adapters' A rows join the projections (int8: beside them)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model_dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.dtype not in PLAIN_DTYPES and self.lib is None:
            raise ValueError(f"model_dtype {self.dtype} needs the native kernels (a C++ compiler, LLM_SERVING_NATIVE "
                             "not 0, a CPU device); the plain-MindSpore path runs float32 or float16 (MindSpore 2.9 "
                             "has no bfloat16 MatMul on CPU)")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_dtype!r}: one of {', '.join(KV_DTYPES)} or auto")
        if self.tp_size > 1 and self.dtype in ("int8", "gguf"):
            raise ValueError("tensor_parallel_size > 1 runs a float model_dtype (float32, bfloat16, float16)")
        if self.lora is not None and self.dtype == "gguf":
            raise ValueError("LoRA adapters run on float32, bfloat16, float16 or int8 bases, not on gguf blocks yet")
        if self.kv_dtype not in PLAIN_DTYPES and self.lib is None:
            raise ValueError(f"kv_cache_dtype {self.kv_dtype} needs the native kernels (paged attention reads "
                             "bfloat16 and int8 KV there); the plain-MindSpore path keeps float32 or float16")

    def kernels(self, cfg: ModelConfig) -> dict[str, Any]:
        if self.lib is None:
            return {}
        return custom_ops(self.lib, self.tp_size)

    def collectives(self, cfg: ModelConfig, k: dict[str, Any]) -> nn.Cell:
        if self.tp_size == 1:
            return Alone()
        padded = self.head_width(cfg) * self.tp_size
        return ShmCollectives(k, cfg.vocab_size, padded) if self.lib else CommCollectives(self.tp_size, cfg.vocab_size, padded)

    def one_op(self, cfg: ModelConfig) -> bool:
        """Whether one op runs every decoder layer (agent/kernels/decoder_stack.cpp), taking each
        kind's weights and the KV caches stacked. Not on the plain path, tensor parallel (partial
        sums are combined between a layer's parts) or float weights padded to whole blocks (the
        padding would have to be cut between the parts)."""
        if self.lib is None or self.tp_size > 1 or self.dtype == "gguf":  # gguf: layers' sizes differ
            return False
        widths = self.widths(cfg)
        return self.dtype == "int8" or all(widths[n] % WEIGHT_BLOCK == 0 for n in LAYER_KINDS)

    def stack_op(self, cfg: ModelConfig, k: dict[str, Any]) -> Any:
        """The op that runs every decoder layer, or None where layers keep four ops (`one_op`)."""
        return k[self.projection_cls.stack_op_name] if self.one_op(cfg) else None

    def widths(self, cfg: ModelConfig) -> dict[str, int]:
        """Output columns of each projection kind on this rank (with LoRA, its adapters' A rows too)."""
        extra = (lambda kind: self.lora.extra(kind, self.dtype != "int8")) if self.lora is not None else (lambda kind: 0)
        return {"qkv": (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + extra("qkv"),
                "o": cfg.hidden_size + extra("o"), "gate_up": 2 * cfg.intermediate_size + extra("gate_up"),
                "down": cfg.hidden_size + extra("down"), "head": self.head_width(cfg)}

    def head_width(self, cfg: ModelConfig) -> int:
        """This rank's share of the vocabulary (padded to equal shares)."""
        return -(-cfg.vocab_size // self.tp_size)

    def norms(self, cfg: ModelConfig, k: dict[str, Any]) -> nn.Cell:
        if self.lib:
            return NativeNorms(cfg.rms_eps, cfg.family.activation, k)
        return PlainNorms(cfg.rms_eps, cfg.intermediate_size, cfg.family.activation)

    def attention(self, cfg: ModelConfig, block_size: int, k: dict[str, Any]) -> nn.Cell:
        return NativeAttention(cfg, block_size, k) if self.lib else PlainAttention(cfg, block_size, self.kv_dtype)

    @property
    def projection_cls(self) -> type[Projection]:
        if self.lib is None:
            return PlainF16Linear if self.dtype == "float16" else PlainLinear
        return {"float32": F32Linear, "bfloat16": Bf16Linear, "float16": F16Linear, "int8": Int8Linear,
                "gguf": GgufLinear}[self.dtype]

    def embedding(self, cfg: ModelConfig, w: dict[str, Any], k: dict[str, Any]) -> tuple[nn.Cell, Any]:
        """The embedding's cell, and what a tied LM head is made of: the float table, or (gguf) the cell
        itself, whose blocks the head then reads."""
        if self.dtype == "gguf":
            cell = BlockEmbedding(w["model.embed_tokens.weight"], embedding_scale(cfg), k)
            return cell, cell
        table = embedding(w).astype(np.float32, copy=False)
        return TableEmbedding(table, embedding_scale(cfg)), table

    def projections(self, cfg: ModelConfig, w: dict[str, Any], attn_scale: float, norms: nn.Cell,
                    k: dict[str, Any], embed: Any = None) -> dict[str, Projection]:
        """qkv, o, gate_up, down and head (from `embed` when tied and given: `embedding`'s second
        item), converted one layer at a time (a large model never holds a second full copy)."""
        cls = self.projection_cls
        stacked = self.one_op(cfg)
        kinds = {name: LayerWeights(name, cfg.num_layers, stacked) for name in LAYER_KINDS}
        for i, layer in enumerate(self._prepared(cfg, w, attn_scale)):
            for name, prep in layer.items():
                kinds[name].add(i, cls.stored(prep))
        widths = self.widths(cfg)
        out = {name: cls(norms, lw.parameters(), k, widths[name]) for name, lw in kinds.items()}
        out["head"] = self._head(cfg, w, norms, k, embed)
        return out

    def _head(self, cfg: ModelConfig, w: dict[str, Any], norms: nn.Cell, k: dict[str, Any], embed: Any) -> Projection:
        cls, lw = self.projection_cls, LayerWeights("head", 1, False)
        gain = np.asarray(w["model.norm.weight"], np.float32)
        if isinstance(embed, BlockEmbedding):  # tied: the embedding's own blocks, not a copy
            rs, g = (param(f"head0_{s}", a) for s, a in ((2, np.ones(cfg.vocab_size, np.float32)), (3, gain)))
            return cls(norms, [ms.ParameterTuple([p]) for p in (embed.w, embed.seg, rs, g)], k, self.head_width(cfg))
        if self.dtype == "gguf":
            lw.add(0, cls.stored(([w["lm_head.weight"]], [1.0], gain)))
        else:
            head, gain = lm_head(cfg, w, self.dtype == "int8", self.ranges, self.int8_group, embed)
            # int8 applies the final norm's gain where it quantises; float weights fold it into the head
            lw.add(0, cls.stored((head, gain) if self.dtype == "int8" else head * gain[None, :]))
        return cls(norms, lw.parameters(), k, self.head_width(cfg))

    def _prepared(self, cfg: ModelConfig, w: dict[str, Any], attn_scale: float) -> Iterator[dict[str, Any]]:
        if self.dtype == "gguf":
            return gguf_projections(cfg, w, attn_scale)
        if self.dtype == "int8":
            return int8_projections(cfg, w, attn_scale, self.ranges, self.int8_group, self.lora)
        return fp32_projections(cfg, w, attn_scale, self.lora)
