"""Projections: one class per weight format, each owning its parameters and its call (fused with
the norm before it, the activation before it or the attention before it where the kernels allow).
One Cell per kind (qkv, o, gate_up, down: every layer's matrix in one tuple; the LM head as a
one-layer projection). Norm cells hold no parameters, so projections share them."""
from __future__ import annotations

from typing import Any

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from agent.kernels import pack_int8_channel
from agent.model.params import WEIGHT_BLOCK, param, zeros_param
from agent.model.quant import bf16_bits

LAYER_KINDS = ("qkv", "o", "gate_up", "down")


class LayerWeights:
    """One projection kind's arrays (as `Projection.stored` makes them), collected layer by layer
    into Parameters: a ParameterTuple of every layer's own per array, or (`stacked`) one Parameter
    [layers, ...] per array, filled in place: a CPU Parameter shares its memory with `asnumpy()`,
    so neither way holds a second full copy of the kind."""

    def __init__(self, name: str, layers: int, stacked: bool):
        self.name, self.layers, self.stacked = name, layers, stacked
        self.slots: list[Any] = []

    def add(self, i: int, arrays: tuple[np.ndarray, ...]) -> None:
        if not self.slots:
            self.slots = [zeros_param(f"{self.name}_{s}", (self.layers, *a.shape), a.dtype) if self.stacked
                          else [] for s, a in enumerate(arrays)]
        for s, a in enumerate(arrays):
            if self.stacked:
                view = self.slots[s].asnumpy()
                if not np.shares_memory(view, self.slots[s].asnumpy()):  # a MindSpore that copies here
                    raise RuntimeError("Parameter.asnumpy() returned a copy: stacked weights cannot be filled")
                view[i] = a
            else:
                self.slots[s].append(param(f"{self.name}{i}_{s}", a))

    def parameters(self) -> list[Any]:
        return [p if self.stacked else ms.ParameterTuple(p) for p in self.slots]


class Projection(nn.Cell):
    """x @ W_i for layer i of one projection kind. `weights`: per array `stored` makes, every
    layer's as a ParameterTuple, or stacked in one Parameter [layers, ...] (`stacked`: the stack op
    takes them so; the four-op path indexes layers)."""

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__()
        self.norms = norms
        for slot, w in enumerate(weights):
            setattr(self, f"w{slot}", w)

    @staticmethod
    def stored(prepared: Any) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def layer_view(self, i: int, array: int = 0) -> np.ndarray:
        """Layer i's stored weight array (the first, or `array`), on the Parameter's own memory."""
        w = getattr(self, f"w{array}")
        return w[i].asnumpy() if isinstance(w, ms.ParameterTuple) else w.asnumpy()[i]

    def put_rows(self, i: int, start: int, rows: np.ndarray) -> None:
        """Output rows start.. of layer i's matrix [out, in] (LoRA slots: agent.model.lora.write_slot)."""
        raise NotImplementedError(f"{type(self).__name__} holds no LoRA rows")

    def add_norm_linear(self, x: Tensor, delta: Tensor, i: int) -> tuple:
        """The residual add, the RMSNorm after it and this projection: (x + delta, rms(x + delta) @ W_i)."""
        x, h = self.norms.add_rms(x, delta)
        return x, self.linear(h, i)

    def swiglu_linear(self, gu: Tensor, i: int) -> Tensor:
        return self.linear(self.norms.swiglu(gu), i)

    def attention_linear(self, attn: nn.Cell, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pro: Tensor, i: int) -> Tensor:
        """Layer i's attention from its Q|K|V projection and prologue `pro` (`attn`: agent.model.attention's
        cell; the step's keys and values go into the caches) and this projection of it."""
        return self.linear(attn.rope_attention(qkv, c, slots, k_cache, v_cache, pro, i), i)


class PlainLinear(Projection):
    """MindSpore MatMul on one [out, in] copy (transpose_b: the layout Ascend and GPU kernels take).
    On CPU this fallback is slower at few rows than an [in, out] copy would be (docs/perf-notes.md); the CPU runs the native kernels instead, and a second copy of every weight is
    what a 7B model cannot afford."""

    dtype: Any = np.float32

    @classmethod
    def stored(cls, mat: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.ascontiguousarray(mat, cls.dtype),)

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.matmul_t = ops.MatMul(transpose_b=True)

    def linear(self, x: Tensor, i: int) -> Tensor:
        return self.matmul_t(x, self.w0[i])

    def put_rows(self, i: int, start: int, rows: np.ndarray) -> None:
        self.layer_view(i)[start:start + rows.shape[0]] = rows.astype(self.dtype)


class PlainF16Linear(PlainLinear):
    """float16 weights and MatMul (the contest's dtype on a device; a CPU kernel in MindSpore too).
    The residual stream, norm statistics, softmax and logits' log-sum-exp stay float32: each
    projection's input is cast down and its output back up."""

    dtype = np.float16

    def linear(self, x: Tensor, i: int) -> Tensor:
        return ops.cast(self.matmul_t(ops.cast(x, ms.float16), self.w0[i]), ms.float32)


class NativeLinear(Projection):
    """A projection on a native op (`op_name`), with the norm, SwiGLU or attention feeding it fused
    into its op (`fused`; agent/kernels/fused_linear.cpp and linear_int8.cpp): 4 ops a layer, which
    agent/kernels/decoder_stack.cpp runs for every layer in one op (`stack_op_name`) where the
    model allows it."""

    op_name = ""
    fused = ("", "", "")
    stack_op_name = ""  # every decoder layer as one op (agent/kernels/decoder_stack.cpp)

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.op = k[self.op_name]
        self.add_rms_op, self.swiglu_op, self.attn_op = (k[name] for name in self.fused)

    def weights(self, i: int) -> tuple:
        """Layer i's weight inputs, as this class's ops take them."""
        raise NotImplementedError

    def every_layer(self) -> tuple:
        """The stacked weights, input by input (the stack op's layout)."""
        raise NotImplementedError

    def linear(self, x: Tensor, i: int) -> Tensor:
        return self.op(x, *self.weights(i))

    def add_norm_linear(self, x: Tensor, delta: Tensor, i: int) -> tuple:
        return self.add_rms_op(x, delta, self.norms.eps, *self.weights(i))

    def swiglu_linear(self, gu: Tensor, i: int) -> Tensor:
        return self.swiglu_op(gu, self.norms.eps, *self.weights(i))

    def attention_linear(self, attn: nn.Cell, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pro: Tensor, i: int) -> Tensor:
        return self.attn_op(*attn.inputs(qkv, c, slots, k_cache, v_cache, pro), *self.weights(i))


class F32Linear(NativeLinear):
    """fp32 weights in column blocks [N/64, K, 64] (agent/kernels/linear_blocks.cpp): a streaming
    loop for a few rows (a one-row step at the memory bandwidth), oneDNN's batched matmul for many.
    Widths that are not a multiple of 64 are padded and the extra columns dropped."""

    op_name = "linear_blocks"
    fused = ("add_rms_linear", "swiglu_linear", "rope_attention_linear")
    stack_op_name = "decoder_stack"

    @staticmethod
    def convert(mat: np.ndarray) -> np.ndarray:
        return np.asarray(mat, np.float32)

    @classmethod
    def stored(cls, mat: np.ndarray) -> tuple[np.ndarray, ...]:
        n, k = mat.shape
        pad = -n % WEIGHT_BLOCK
        blocks = cls.convert(np.pad(mat, ((0, pad), (0, 0))) if pad else mat)
        return (np.ascontiguousarray(blocks.reshape(-1, WEIGHT_BLOCK, k).transpose(0, 2, 1)),)

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.width = width
        self.padded = width % WEIGHT_BLOCK != 0

    def out(self, y: Tensor) -> Tensor:
        return y[:, :self.width] if self.padded else y

    def put_rows(self, i: int, start: int, rows: np.ndarray) -> None:
        view = self.layer_view(i)  # [N/64, K, 64]: output row c is column c % 64 of block c // 64
        for r, row in enumerate(rows):
            c = start + r
            view[c // WEIGHT_BLOCK, :, c % WEIGHT_BLOCK] = self.convert(row)

    def weights(self, i: int) -> tuple:
        return (self.w0[i],)

    def every_layer(self) -> tuple:
        return (self.w0,)

    def linear(self, x: Tensor, i: int) -> Tensor:
        return self.out(self.op(x, self.w0[i]))

    def add_norm_linear(self, x: Tensor, delta: Tensor, i: int) -> tuple:
        x, y = self.add_rms_op(x, delta, self.norms.eps, self.w0[i])
        return x, self.out(y)

    def swiglu_linear(self, gu: Tensor, i: int) -> Tensor:
        return self.out(self.swiglu_op(gu, self.norms.eps, self.w0[i]))

    def attention_linear(self, attn: nn.Cell, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pro: Tensor, i: int) -> Tensor:
        return self.out(self.attn_op(*attn.inputs(qkv, c, slots, k_cache, v_cache, pro), self.w0[i]))


class Bf16Linear(F32Linear):
    """bf16 weights, same blocks and kernel: half the memory and bytes streamed per step; oneDNN's
    bf16 matmul for many rows where the CPU has AVX512-BF16 or AMX."""

    @staticmethod
    def convert(mat: np.ndarray) -> np.ndarray:
        return bf16_bits(mat)


class F16Linear(F32Linear):
    """float16 weights, same blocks and kernel; activations stay fp32 (f16's range would overflow
    on large ones), weights widened as they are read."""

    @staticmethod
    def convert(mat: np.ndarray) -> np.ndarray:
        return np.asarray(mat, np.float16)


class Int8Linear(NativeLinear):
    """W8A8 (agent/kernels/linear_int8.cpp): int8 rows, their group scales and the input factor
    (norm gain over the smoothing factor) applied where the kernel quantises the activations; the
    norm and SwiGLU feeding a projection run in that same pass (a dispatch less each). Rows with one
    scale per channel are stored as oneDNN packs them for this CPU (agent/kernels/int8_channel.cpp).
    With LoRA, a fourth array: every slot's A rows in float32 (the norm's gain folded in), which the
    kernel multiplies by the float input before quantising it (the adapters stay float)."""

    op_name = "linear_i8"
    fused = ("add_rms_linear_i8", "swiglu_linear_i8", "rope_attention_linear_i8")
    stack_op_name = "decoder_stack_i8"

    @staticmethod
    def stored(prepared: tuple) -> tuple[np.ndarray, ...]:
        rows, gain, *lora_a = prepared
        q = pack_int8_channel(rows.q) if rows.channel else rows.q
        return (q, rows.scale, np.asarray(gain, np.float32), *(np.ascontiguousarray(a, np.float32) for a in lora_a))

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.arrays, self.width = len(weights), width

    def weights(self, i: int) -> tuple:
        if self.arrays == 4:  # a constant: graph mode keeps one branch
            return self.w0[i], self.w1[i], self.w2[i], self.w3[i]
        return self.w0[i], self.w1[i], self.w2[i]

    def every_layer(self) -> tuple:
        if self.arrays == 4:
            return self.w0, self.w1, self.w2, self.w3
        return self.w0, self.w1, self.w2

    def put_rows(self, i: int, start: int, rows: np.ndarray) -> None:
        if self.arrays < 4:
            super().put_rows(i, start, rows)  # raises: no LoRA rows here
        a = self.layer_view(i, 3)
        first = start - (self.width - a.shape[0])  # A's rows follow the weight's own output columns
        a[first:first + rows.shape[0]] = rows
