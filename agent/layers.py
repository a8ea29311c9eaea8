"""The decoder's parts as objects, chosen once at load by `Backend`: one projection class per
weight format, each owning its parameters and its call, and one ops class per kernel set (norms,
rope, SwiGLU, paged attention). agent.model composes them and has no dtype branches.

Projections are one Cell per kind (qkv, o, gate_up, down: every layer's matrix in one tuple; the LM
head as a one-layer projection). Norm/ops cells hold no parameters, so projections share them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from agent.kernels import custom_ops, line_aligned
from agent.projections import fp32_projections, int8_projections, lm_head
from agent.attention import NativeAttention, PlainAttention
from agent.quant import Int8Rows
from common.config import QUANT_GROUP_SIZE

BF16_BLOCK = 64  # output columns per weight block (agent/kernels/linear_blocks.cpp)
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


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


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


# ------------------------------------------------------------------ projections
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

    def add_norm_linear(self, x: Tensor, delta: Tensor, i: int) -> tuple:
        """The residual add, the RMSNorm after it and this projection: (x + delta, rms(x + delta) @ W_i)."""
        x, h = self.norms.add_rms(x, delta)
        return x, self.linear(h, i)

    def swiglu_linear(self, gu: Tensor, i: int) -> Tensor:
        return self.linear(self.norms.swiglu(gu), i)

    def attention_linear(self, attn: nn.Cell, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pro: Tensor, i: int) -> Tensor:
        """Layer i's attention from its Q|K|V projection and prologue `pro` (`attn`: agent.attention's
        cell; the step's keys and values go into the caches) and this projection of it."""
        return self.linear(attn.rope_attention(qkv, c, slots, k_cache, v_cache, pro, i), i)


class PlainLinear(Projection):
    """MindSpore MatMul on one [out, in] copy (transpose_b: the layout Ascend and GPU kernels take).
    On CPU this fallback is ~2.5x slower at few rows than an [in, out] copy would be; the CPU runs
    the native kernels instead, and a second copy of every weight is what a 7B model cannot afford."""

    @staticmethod
    def stored(mat: np.ndarray) -> tuple[np.ndarray, ...]:
        return (np.ascontiguousarray(mat, np.float32),)

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.matmul_t = ops.MatMul(transpose_b=True)

    def linear(self, x: Tensor, i: int) -> Tensor:
        return self.matmul_t(x, self.w0[i])


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
        pad = -n % BF16_BLOCK
        blocks = cls.convert(np.pad(mat, ((0, pad), (0, 0))) if pad else mat)
        return (np.ascontiguousarray(blocks.reshape(-1, BF16_BLOCK, k).transpose(0, 2, 1)),)

    def __init__(self, norms: nn.Cell, weights: list[Any], k: dict[str, Any], width: int):
        super().__init__(norms, weights, k, width)
        self.width = width
        self.padded = width % BF16_BLOCK != 0

    def out(self, y: Tensor) -> Tensor:
        return y[:, :self.width] if self.padded else y

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
    norm and SwiGLU feeding a projection run in that same pass (a dispatch less each)."""

    op_name = "linear_i8"
    fused = ("add_rms_linear_i8", "swiglu_linear_i8", "rope_attention_linear_i8")
    stack_op_name = "decoder_stack_i8"

    @staticmethod
    def stored(prepared: tuple[Int8Rows, np.ndarray]) -> tuple[np.ndarray, ...]:
        rows, gain = prepared
        return rows.q, rows.scale, np.asarray(gain, np.float32)

    def weights(self, i: int) -> tuple:
        return self.w0[i], self.w1[i], self.w2[i]

    def every_layer(self) -> tuple:
        return self.w0, self.w1, self.w2

    def linear(self, x: Tensor, i: int) -> Tensor:
        return self.op(x, self.w0[i], self.w1[i], self.w2[i])

    def add_norm_linear(self, x: Tensor, delta: Tensor, i: int) -> tuple:
        return self.add_rms_op(x, delta, self.norms.eps, self.w0[i], self.w1[i], self.w2[i])

    def swiglu_linear(self, gu: Tensor, i: int) -> Tensor:
        return self.swiglu_op(gu, self.norms.eps, self.w0[i], self.w1[i], self.w2[i])

    def attention_linear(self, attn: nn.Cell, qkv: Tensor, c: tuple, slots: Tensor, k_cache: Tensor,
                         v_cache: Tensor, pro: Tensor, i: int) -> Tensor:
        return self.attn_op(*attn.inputs(qkv, c, slots, k_cache, v_cache, pro), self.w0[i], self.w1[i],
                            self.w2[i])


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


# ------------------------------------------------------------------ the backend, chosen once
@dataclass(frozen=True)
class Backend:
    """Which kernels a model runs on: `dtype` (float32 | bfloat16 | int8) of the projections and LM
    head, `lib` the native kernel library (None: plain MindSpore ops, float32 only)."""

    dtype: str = "float32"
    lib: str | None = None
    kv_dtype: str = "float32"  # the KV cache's (KV_DTYPES); the plain path keeps float32
    int8_group: int = QUANT_GROUP_SIZE
    ranges: dict[str, list[np.ndarray]] | None = None  # agent.calibrate's activation ranges (int8)
    tp_size: int = 1  # tensor-parallel ranks: this model is one rank's shard (agent.tensor_parallel)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model_dtype {self.dtype!r}: one of {', '.join(DTYPES)}")
        if self.dtype != "float32" and self.lib is None:
            raise ValueError(f"model_dtype {self.dtype} needs the native kernels (a C++ compiler, LLM_SERVING_NATIVE "
                             "not 0, a CPU device); the plain-MindSpore path runs float32 only")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_dtype!r}: one of {', '.join(KV_DTYPES)} or auto")
        if self.tp_size > 1 and self.dtype == "int8":
            raise ValueError("tensor_parallel_size > 1 runs a float model_dtype (float32, bfloat16, float16)")
        if self.kv_dtype != "float32" and self.lib is None:
            raise ValueError(f"kv_cache_dtype {self.kv_dtype} needs the native kernels (paged attention reads 16-bit "
                             "and int8 KV there); the plain-MindSpore path keeps float32")

    def kernels(self, cfg: Any) -> dict[str, Any]:
        if self.lib is None:
            return {}
        return custom_ops(self.lib, self.tp_size)

    def collectives(self, cfg: Any, k: dict[str, Any]) -> nn.Cell:
        if self.tp_size == 1:
            return Alone()
        padded = self.head_width(cfg) * self.tp_size
        return ShmCollectives(k, cfg.vocab_size, padded) if self.lib else CommCollectives(self.tp_size, cfg.vocab_size, padded)

    def one_op(self, cfg: Any) -> bool:
        """Whether one op runs every decoder layer (agent/kernels/decoder_stack.cpp), taking each
        kind's weights and the KV caches stacked. Not on the plain path, tensor parallel (partial
        sums are combined between a layer's parts) or float weights padded to whole blocks (the
        padding would have to be cut between the parts)."""
        if self.lib is None or self.tp_size > 1:
            return False
        widths = self.widths(cfg)
        return self.dtype == "int8" or all(widths[n] % BF16_BLOCK == 0 for n in LAYER_KINDS)

    def stack_op(self, cfg: Any, k: dict[str, Any]) -> Any:
        """The op that runs every decoder layer, or None where layers keep four ops (`one_op`)."""
        return k[self.projection_cls.stack_op_name] if self.one_op(cfg) else None

    def widths(self, cfg: Any) -> dict[str, int]:
        """Output columns of each projection kind on this rank."""
        return {"qkv": (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, "o": cfg.hidden_size,
                "gate_up": 2 * cfg.intermediate_size, "down": cfg.hidden_size, "head": self.head_width(cfg)}

    def head_width(self, cfg: Any) -> int:
        """This rank's share of the vocabulary (padded to equal shares)."""
        return -(-cfg.vocab_size // self.tp_size)

    def norms(self, cfg: Any, k: dict[str, Any]) -> nn.Cell:
        if self.lib:
            return NativeNorms(cfg.rms_eps, cfg.activation, k)
        return PlainNorms(cfg.rms_eps, cfg.intermediate_size, cfg.activation)

    def attention(self, cfg: Any, block_size: int, k: dict[str, Any]) -> nn.Cell:
        return (NativeAttention if self.lib else PlainAttention)(cfg, block_size, k)

    @property
    def projection_cls(self) -> type[Projection]:
        if self.lib is None:
            return PlainLinear
        return {"float32": F32Linear, "bfloat16": Bf16Linear, "float16": F16Linear, "int8": Int8Linear}[self.dtype]

    def projections(self, cfg: Any, w: dict[str, Any], attn_scale: float, norms: nn.Cell,
                    k: dict[str, Any], embed: np.ndarray | None = None) -> dict[str, Projection]:
        """qkv, o, gate_up, down and head (from `embed` when tied and given), converted one layer at a
        time (a large model never holds a second full copy)."""
        cls = self.projection_cls
        stacked = self.one_op(cfg)
        kinds = {name: LayerWeights(name, cfg.num_layers, stacked) for name in LAYER_KINDS}
        for i, layer in enumerate(self._prepared(cfg, w, attn_scale)):
            for name, prep in layer.items():
                kinds[name].add(i, cls.stored(prep))
        head, gain = lm_head(cfg, w, self.dtype == "int8", self.ranges, self.int8_group, embed)
        kinds["head"] = LayerWeights("head", 1, False)
        # int8 applies the final norm's gain where it quantises; float weights fold it into the head
        kinds["head"].add(0, cls.stored((head, gain) if self.dtype == "int8" else head * gain[None, :]))
        widths = self.widths(cfg)
        return {name: cls(norms, lw.parameters(), k, widths[name]) for name, lw in kinds.items()}

    def _prepared(self, cfg: Any, w: dict[str, Any], attn_scale: float) -> Iterator[dict[str, Any]]:
        if self.dtype == "int8":
            return int8_projections(cfg, w, attn_scale, self.ranges, self.int8_group)
        return fp32_projections(cfg, w, attn_scale)
