"""The decoder's norms and element-wise parts, chosen once at load by agent.model.backend.Backend:
plain MindSpore ops (any device) or one native op each."""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Tensor, nn, ops

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
