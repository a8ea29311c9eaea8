"""How the ranks of a tensor-parallel group combine their partial sums and vocabulary shards, chosen
once at load by agent.model.backend.Backend. (agent.tensor_parallel, which sets groups up, stays
importable without MindSpore: the launcher uses it.)"""
from __future__ import annotations

from typing import Any

from mindspore import Tensor, nn, ops

class Alone(nn.Cell):
    """A model on one rank: nothing to combine."""

    def reduce(self, x: Tensor) -> Tensor:
        return x

    def gather(self, logits: Tensor) -> Tensor:
        return logits


class ShmCollectives(nn.Cell):
    """One rank of a tensor-parallel group on this host (agent/kernels/collective.cpp): o_proj's and
    down's partial sums all-reduced, the vocabulary-parallel head's logits gathered."""

    def __init__(self, k: dict[str, Any], vocab: int, padded: int):
        super().__init__()
        self.all_reduce, self.all_gather, self.vocab, self.padded = k["all_reduce"], k["all_gather"], vocab, padded

    def reduce(self, x: Tensor) -> Tensor:
        return self.all_reduce(x)

    def gather(self, logits: Tensor) -> Tensor:
        full = self.all_gather(logits)
        return full[:, :self.vocab] if self.padded != self.vocab else full


class CommCollectives(nn.Cell):
    """The same through mindspore.communication (mccl on CPU, HCCL on Ascend, NCCL on GPU): the
    plain-MindSpore path's and other devices' collectives (on CPU far slower than the native ones:
    docs/perf-notes.md)."""

    def __init__(self, size: int, vocab: int, padded: int):
        super().__init__()
        self.all_reduce, self.all_gather = ops.AllReduce(), ops.AllGather()
        self.size, self.vocab, self.padded = size, vocab, padded

    def reduce(self, x: Tensor) -> Tensor:
        return self.all_reduce(x)

    def gather(self, logits: Tensor) -> Tensor:
        rows = logits.shape[0]
        full = self.all_gather(logits).reshape(self.size, rows, -1).transpose(1, 0, 2).reshape(rows, -1)  # ranks' columns side by side
        return full[:, :self.vocab] if self.padded != self.vocab else full
