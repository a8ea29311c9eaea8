"""Parameters on cache-line-aligned memory, and the dtypes weights and KV caches are stored in."""
from __future__ import annotations

from typing import Any

import numpy as np
from mindspore import Parameter, Tensor

from agent.kernels import line_aligned

WEIGHT_BLOCK = 64  # output columns per weight block (agent/kernels/linear_blocks.cpp); LoRA's extra rows come in whole blocks
DTYPES = ("float32", "bfloat16", "float16", "int8", "gguf")
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
