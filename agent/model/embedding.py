"""The token embedding: rows of a float32 table (gathered), or of a GGUF file's quantised blocks as
stored (model_dtype `gguf`: dequantised a token at a time, agent/kernels/linear_gguf.cpp)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from mindspore import Tensor, nn, ops

from agent.model.blocks import BlockRows, segments
from agent.model.params import param


class TableEmbedding(nn.Cell):
    """float32 rows [vocab, hidden], Gemma's sqrt(hidden) folded in (`scale`)."""

    def __init__(self, table: np.ndarray, scale: float):
        super().__init__()
        self.table = param("embed", table * np.float32(scale) if scale != 1.0 else table)

    def construct(self, tokens: Tensor) -> Tensor:
        return ops.gather(self.table, tokens, 0)


class BlockEmbedding(nn.Cell):
    """Token rows dequantised from the embedding's blocks as stored (one row a token); `scale`:
    Gemma's sqrt(hidden) (1 elsewhere). A tied LM head reads the same Parameters (`w`, `seg`)."""

    def __init__(self, rows: BlockRows, scale: float, k: dict[str, Any]):
        super().__init__()
        w, seg, _ = segments([rows], [1.0])
        self.w, self.seg = param("embed_blocks", w), param("embed_seg", seg)
        self.scale = param("embed_scale", np.full(rows.cols, scale, np.float32))
        self.op = k["embed_gguf"]

    def construct(self, tokens: Tensor) -> Tensor:
        return self.op(tokens, self.w, self.seg, self.scale)


def embedding_scale(cfg: Any) -> float:
    return math.sqrt(cfg.hidden_size) if cfg.family.embed_scale else 1.0
