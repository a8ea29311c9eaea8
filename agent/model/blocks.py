"""GGUF's quantised rows as the file stores them (model_dtype `gguf`): the bytes of each row's
blocks, read by agent/kernels/linear_gguf.cpp as they are. A projection joins the rows of several
tensors (Q|K|V, gate|up), each of its own type: its weight is their bytes one after another, with a
segment table (type, rows, byte offset) the kernel walks."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent.kernels import CACHE_LINE

# GGML type -> (values, bytes) a block: the types the kernels read as stored (agent/kernels/gguf_blocks.h)
BLOCK_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
               14: (256, 210)}
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@dataclass(frozen=True)
class BlockRows:
    """A matrix [rows, cols] as GGUF blocks: `data` [rows, bytes a row] uint8, of GGML type `kind`."""

    kind: int
    data: np.ndarray
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def take(self, rows: np.ndarray) -> BlockRows:
        """These rows in another order (llama.cpp's Q/K row permutation undone): a row is its own blocks."""
        return BlockRows(self.kind, np.ascontiguousarray(self.data[rows]), self.cols)

    def dequantize(self) -> np.ndarray:
        """float32, as llama.cpp dequantises (the gguf package's NumPy code: the same bits as the kernel's)."""
        import gguf

        return gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.kind)).astype(np.float32).reshape(self.shape)


def segments(parts: list[BlockRows], row_scales: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's (w, seg, rs) for the rows of `parts` in turn, part i's rows times row_scales[i]:
    each part's bytes start on a cache line."""
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += -(-p.data.nbytes // CACHE_LINE) * CACHE_LINE
    w = np.zeros(at, np.uint8)
    for p, o in zip(parts, offsets):
        w[o:o + p.data.nbytes] = p.data.reshape(-1)
    seg = np.array([[p.kind, p.shape[0], o] for p, o in zip(parts, offsets)], np.int64)
    rs = np.concatenate([np.full(p.shape[0], s, np.float32) for p, s in zip(parts, row_scales)])
    return w, seg, rs


def type_counts(kinds: list[int]) -> str:
    """'Q4_K x 27, Q6_K x 9': how many tensors of each GGML type (the kernels line and /info)."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[TYPE_NAMES[kind]] = counts.get(TYPE_NAMES[kind], 0) + 1
    return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items()))
