"""Int8 weights for the W8A8 projections (agent/kernels/linear_int8.cpp): symmetric, one scale per
group of G consecutive inputs of each output channel (G a multiple of 32; None: one scale per row),
rows zero-padded to a whole number of groups."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VECTOR = 32  # bytes per vector step of the kernel: groups and padded rows are multiples of it
QMAX = 127  # symmetric: -128 never occurs, so |x| * sign(w) in the kernel cannot overflow
ALPHA = 0.5  # SmoothQuant's migration strength (agent/calibrate); 0.4-0.5 measured best on SmolLM2


@dataclass
class Int8Rows:
    """w ≈ q[:, :k] * (scale repeated over each group); q [N, Kp] int8, scale [N, Kp / G] float32."""
    q: np.ndarray
    scale: np.ndarray
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.k

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def __getitem__(self, rows: slice | np.ndarray) -> "Int8Rows":
        return Int8Rows(self.q[rows], self.scale[rows], self.k)

    def scaled(self, factor: float) -> "Int8Rows":
        """The same rows times a constant (the attention scale folded into the query rows)."""
        return Int8Rows(self.q, (self.scale * factor).astype(np.float32), self.k)

    def dequantize(self) -> np.ndarray:
        n, kp = self.q.shape
        w = self.q.reshape(n, -1, self.group).astype(np.float32) * self.scale[..., None]
        return w.reshape(n, kp)[:, :self.k]


def quantize(w: np.ndarray, group: int | None = None) -> Int8Rows:
    """Float weights [N, K] -> int8 with scale max|w| / 127 per group (round to nearest)."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    g = group or -(-k // VECTOR) * VECTOR
    if g % VECTOR:
        raise ValueError(f"int8 group size {g} is not a multiple of {VECTOR}")
    kp = -(-k // g) * g
    padded = np.zeros((n, kp), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, kp // g, g)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(QMAX, amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(n, kp)
    return Int8Rows(q, (amax / QMAX).astype(np.float32), k)


def from_q8_0(q: np.ndarray, d: np.ndarray) -> Int8Rows:
    """GGUF Q8_0 (q [N, K] int8, one float16 scale per 32 values d [N, K/32]) as it is stored: the
    kernel takes groups of 32, so its integers are used unchanged."""
    if q.shape[1] % VECTOR:
        raise ValueError("Q8_0 rows must be whole blocks of 32")
    return Int8Rows(np.clip(q, -QMAX, QMAX), d.astype(np.float32), q.shape[1])  # Q8_0 may hold -128


def concat(parts: list[Int8Rows]) -> Int8Rows:
    """Stacked output channels (fused Q|K|V and gate|up projections); one group size."""
    return Int8Rows(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), parts[0].k)


def smoothing(act_max: np.ndarray, weight_col_max: np.ndarray) -> np.ndarray:
    """Per input channel factor s (agent/calibrate): the activation is divided by it, the weight
    column multiplied."""
    s = np.maximum(act_max, 1e-5) ** ALPHA / np.maximum(weight_col_max, 1e-5) ** (1 - ALPHA)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)
