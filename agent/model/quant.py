"""Int8 weights for the W8A8 projections (agent/kernels/linear_int8.cpp): symmetric, one scale per
group of G consecutive inputs of each output channel. Rows are cut into blocks of 8 groups and
stored interleaved (vector t of a block holds bytes 4t..4t+3 of each of its 8 groups), so the
kernel's int32 lane l sums group l alone; see the kernel's header. Group CHANNEL: one scale per
output channel, rows in natural order, for oneDNN's int8 matmul (agent/kernels/int8_channel.cpp),
which packs them at load."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.config import CHANNEL_GROUP, QUANT_GROUP_SIZE

LANES = 8  # groups per block: one per int32 lane of the kernel's accumulators
QMAX = 127  # symmetric: -128 never occurs, so |x| * sign(w) in the kernel cannot overflow
ALPHA = 0.5  # SmoothQuant's migration strength (agent/model/calibrate.py); 0.4-0.5 measured best on SmolLM2


CHANNEL = CHANNEL_GROUP  # one scale per output channel (and per token): GPTQ's and vLLM's group size -1
PAD_TOLERANCE = 0.01  # of a row's inputs: padding costs multiply-adds and bytes, a block one scaling pass


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def group_for(k: int, target: int) -> int:
    """Group size for rows of k inputs: a multiple of 4, at most `target` (0: one block of 8 groups
    per row), with the fewest blocks whose zero padding stays within PAD_TOLERANCE of k (up to twice
    the fewest possible; else the least padding). At 72: 576 -> 1 block of 72 (not 2 of 36); 8192 ->
    16 of 64, where 15 of 72 would pad 5.5%; 11008 -> 23 of 60 (22 of 64 pad 2.3%)."""
    if not target:
        return -(-k // (LANES * 4)) * 4
    first = -(-k // (LANES * target))
    best: tuple[int, int] | None = None  # (padding, group)
    for blocks in range(first, 2 * first + 1):
        g = -(-k // (LANES * blocks * 4)) * 4
        pad = blocks * LANES * g - k
        if pad <= PAD_TOLERANCE * k:
            return g
        if best is None or pad < best[0]:
            best = (pad, g)
    return best[1]


def interleave(q: np.ndarray, group: int) -> np.ndarray:
    """[N, Kp] natural order -> the kernel's order (and back with inverse=True via deinterleave)."""
    n, kp = q.shape
    return q.reshape(n, kp // (LANES * group), LANES, group // 4, 4).transpose(0, 1, 3, 2, 4).reshape(n, kp)


def deinterleave(q: np.ndarray, group: int) -> np.ndarray:
    n, kp = q.shape
    return q.reshape(n, kp // (LANES * group), group // 4, LANES, 4).transpose(0, 1, 3, 2, 4).reshape(n, kp)


@dataclass
class Int8Rows:
    """w ≈ natural()[:, :k] * (scale repeated over each group); q [N, Kp] int8 interleaved, scale
    [N, Kp / G] float32 in natural group order, k the logical width."""
    q: np.ndarray
    scale: np.ndarray
    k: int

    @property
    def channel(self) -> bool:
        """One scale per output channel: natural order, no padding."""
        return self.scale.shape[1] == 1 and self.q.shape[1] == self.k

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.k

    @property
    def group(self) -> int:
        return CHANNEL if self.channel else self.q.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def __getitem__(self, rows: slice | np.ndarray) -> "Int8Rows":
        return Int8Rows(self.q[rows], self.scale[rows], self.k)

    def scaled(self, factor: float) -> "Int8Rows":
        """The same rows times a constant (the attention scale folded into the query rows)."""
        return Int8Rows(self.q, (self.scale * factor).astype(np.float32), self.k)

    def natural(self) -> np.ndarray:
        """The int8 values in input order [N, Kp]."""
        return self.q if self.channel else deinterleave(self.q, self.group)

    def dequantize(self) -> np.ndarray:
        n, kp = self.q.shape
        w = self.natural().reshape(n, self.scale.shape[1], -1).astype(np.float32) * self.scale[..., None]
        return w.reshape(n, kp)[:, :self.k]


def _pack(q: np.ndarray, scale: np.ndarray, k: int, group: int) -> Int8Rows:
    """Natural-order int8 [N, K] and scales [N, K / G] (K a multiple of G) -> zero-padded to whole
    blocks (padding groups get scale 0) and interleaved."""
    n = q.shape[0]
    kp = -(-q.shape[1] // (LANES * group)) * LANES * group
    full = np.zeros((n, kp), np.int8)
    full[:, :q.shape[1]] = q
    scales = np.zeros((n, kp // group), np.float32)
    scales[:, :scale.shape[1]] = scale
    return Int8Rows(interleave(full, group), scales, k)


def quantize(w: np.ndarray, group: int = QUANT_GROUP_SIZE, exact: bool = False) -> Int8Rows:
    """Float weights [N, K] -> int8 with scale max|w| / 127 per group of group_for(K, group) inputs,
    or of `group` itself when exact (round to nearest); per output channel where group is CHANNEL."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if group == CHANNEL:
        amax = np.abs(w).max(axis=1, keepdims=True)
        inv = np.divide(QMAX, amax, out=np.zeros_like(amax), where=amax > 0)
        return Int8Rows(np.rint(w * inv).astype(np.int8), (amax / QMAX).astype(np.float32), k)
    g = group if exact else group_for(k, group)
    kg = -(-k // g) * g
    padded = np.zeros((n, kg), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, kg // g, g)
    amax = np.abs(blocks).max(axis=2)
    inv = np.divide(QMAX, amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(n, kg)
    return _pack(q, amax / QMAX, k, g)


def from_q8_0(q: np.ndarray, d: np.ndarray) -> Int8Rows:
    """GGUF Q8_0 (q [N, K] int8, one float16 scale per 32 values d [N, K/32]) as it is stored:
    groups of 32, its integers unchanged (only reordered for the kernel)."""
    if q.shape[1] % 32:
        raise ValueError("Q8_0 rows must be whole blocks of 32")
    return _pack(np.clip(q, -QMAX, QMAX), d.astype(np.float32), q.shape[1], 32)  # Q8_0 may hold -128


def concat(parts: list[Int8Rows]) -> Int8Rows:
    """Stacked output channels (fused Q|K|V and gate|up projections); one group size."""
    return Int8Rows(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), parts[0].k)


def smoothing(act_max: np.ndarray, weight_col_max: np.ndarray) -> np.ndarray:
    """Per input channel factor s (agent/model/calibrate.py): the activation is divided by it, the weight
    column multiplied."""
    s = np.maximum(act_max, 1e-5) ** ALPHA / np.maximum(weight_col_max, 1e-5) ** (1 - ALPHA)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)
