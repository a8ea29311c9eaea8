"""The native kernels called directly, as MindSpore's custom-op ABI calls them, and the exact integer
references of the per-channel int8 recipe: shared by the kernel tests and their ISA-capped children."""
from __future__ import annotations

import numpy as np

from agent.model.quant import Int8Rows


def channel_want(x: np.ndarray, rows: Int8Rows) -> np.ndarray:
    """The per-channel recipe with integer activations whose every token reaches 127 (scale 1):
    the exact integer dot products times each channel's scale."""
    return (x.astype(np.int64) @ rows.q.astype(np.int64).T) * rows.scale[:, 0].astype(np.float64)


def integer_tokens(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    x = rng.integers(-127, 128, (m, k)).astype(np.float32)
    x[:, 0] = 127 * rng.choice([-1, 1], m)  # each token's max is exactly 127
    return x


def call_kernel(lib, fn: str, arrays: list[np.ndarray]) -> int:
    import ctypes as C

    n = len(arrays)
    shapes = [(C.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    return getattr(lib, fn)(n, (C.c_void_p * n)(*[a.ctypes.data for a in arrays]), (C.c_int * n)(*[a.ndim for a in arrays]),
                            (C.POINTER(C.c_int64) * n)(*[C.cast(s, C.POINTER(C.c_int64)) for s in shapes]),
                            (C.c_char_p * n)(*[str(a.dtype).encode() for a in arrays]), None, None)
