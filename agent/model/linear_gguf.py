"""model_dtype `gguf`: the projections, the LM head and the embedding on a GGUF file's quantised blocks
as stored (agent/model/blocks.py; agent/kernels/linear_gguf.cpp). Layers keep four ops each (no
stack op): their weights differ in size from layer to layer (Q4_K_M mixes Q4_K and Q6_K rows)."""
from __future__ import annotations

import numpy as np

from agent.model.blocks import segments
from agent.model.linear import NativeLinear


class GgufLinear(NativeLinear):
    """w (the rows' blocks), seg (their segment table), rs (each output row's factor: the attention
    scale on the query rows) and g (the gain of the norm in front, applied where the kernel quantises
    the activations: quantised weights keep their own values)."""

    op_name = "linear_gguf"
    fused = ("add_rms_linear_gguf", "swiglu_linear_gguf", "rope_attention_linear_gguf")

    @staticmethod
    def stored(prepared: tuple) -> tuple[np.ndarray, ...]:
        parts, scales, gain = prepared
        return (*segments(parts, scales), np.asarray(gain, np.float32))

    def weights(self, i: int) -> tuple:
        return self.w0[i], self.w1[i], self.w2[i], self.w3[i]

    def block_types(self) -> list[int]:
        """The GGML type of every segment of every layer (from the segment tables)."""
        return [int(t) for seg in self.w1 for t in seg.asnumpy()[:, 0]]
