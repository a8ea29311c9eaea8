"""The decoder's parameter-free parts, chosen once at load by agent.backend.Backend: parameters on
cache-line-aligned memory, the norm/element-wise ops (plain MindSpore or the native kernels) and
the tensor-parallel collectives. Projections, which own the weights, are agent.linear's."""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agent.kernels import line_aligned

DTYPES = ("float32", "bfloat16", "float16", "int8")
# KV cache dtypes and how they are stored (MindSpore CPU has no bfloat16 storage: its bits as uint16;
# an int8 head row carries its float32 scale in 4 more bytes: common.memory.kv_head_bytes)
KV_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16, "int8": np.int8}


def _on(name: str, values: np.ndarray) -> Parameter:
    """A Parameter on `values`' own memory. Parameter(Tensor(a)) would copy into MindSpore's
    allocation, 16 or 32 bytes past a cache line (2.9, CPU); set_data() of a from_numpy Tensor keeps
    the NumPy memory, which agent.kernels.line_aligned starts on a line."""
    p = Parameter(Tensor(np.zeros(1, values.dtype)), name=name, requires_grad=False)
    p.set_data(Tensor.from_numpy(values))
    return p


def zeros_param(name: str, shape: tuple[int, ...], dtype: Any, populate: bool = False) -> Parameter:
    """`populate`: every page faulted in now (a write per 4 KiB page), not at its first write."""
    values = line_aligned(shape, dtype)
    if populate:
        values.reshape(-1).view(np.uint8)[::4096] = 0
    return _on(name, values)


def param(name: str, arr: np.ndarray) -> Parameter:
    values = line_aligned(arr.shape, arr.dtype)
    values[...] = arr
    return _on(name, values)


# ------------------------------------------------------------------ norms and element-wise parts
ACTIVATIONS = {"silu": 0.0, "gelu_tanh": 1.0}  # the gated MLP's activation, as the native kernels take it


class PlainNorms(nn.Cell):
    """RMSNorm (its gain lives in the next weight), SwiGLU or GeGLU, a gained RMSNorm (the norms on
    the attention's and MLP's outputs) and the logits' log-sum-exp in MindSpore primitives (any device)."""

    def __init__(self, eps: float, inner: int, activation: str):
        super().__init__()
        self.eps, self.inner, self.gelu = eps, inner, ACTIVATIONS[activation] == 1.0

    def rms(self, x: Tensor) -> Tensor:
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)

    def rms_gain(self, x: Tensor, gain: Tensor) -> Tensor:
        return self.rms(x) * gain

    def add_rms(self, x: Tensor, delta: Tensor) -> tuple:
        x = x + delta
        return x, self.rms(x)

    def swiglu(self, gu: Tensor) -> Tensor:
        gate, up = ops.split(gu, self.inner, 1)
        return (ops.gelu(gate, approximate="tanh") if self.gelu else ops.silu(gate)) * up

    def logsumexp(self, logits: Tensor) -> Tensor:
        peak = logits.max(-1, keepdims=True)
        return ops.log(ops.exp(logits - peak).sum(-1)) + peak.reshape(-1)


class NativeNorms(nn.Cell):
    """The same as one native op each (agent/kernels/fused.cpp): 4-5 MindSpore kernels fewer. `eps`
    holds the norm constants the kernels take: [the RMSNorm's eps, the MLP's activation]."""

    def __init__(self, eps: float, activation: str, k: dict[str, Any]):
        super().__init__()
        self.eps = Tensor(np.array([eps, ACTIVATIONS[activation]], np.float32))
        self.rms_op, self.add_rms_op, self.swiglu_op, self.lse_op = k["rms"], k["add_rms"], k["swiglu"], k["logsumexp"]
        self.rms_gain_op = k["rms_gain"]

    def rms(self, x: Tensor) -> Tensor:
        return self.rms_op(x, self.eps)

    def rms_gain(self, x: Tensor, gain: Tensor) -> Tensor:
        return self.rms_gain_op(x, self.eps, gain)

    def add_rms(self, x: Tensor, delta: Tensor) -> tuple:
        return self.add_rms_op(x, delta, self.eps)

    def swiglu(self, gu: Tensor) -> Tensor:
        return self.swiglu_op(gu, self.eps)

    def logsumexp(self, logits: Tensor) -> Tensor:
        return self.lse_op(logits)


# ------------------------------------------------------------------ tensor-parallel collectives
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
    plain-MindSpore path's and other devices' collectives (0.65-3.6 ms an all-reduce on CPU: 26-340x the native ones)."""

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
