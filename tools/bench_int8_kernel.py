"""One projection on each native path (agent/kernels: the agent's build for this CPU) against oneDNN's
fp32 sgemm (the libdnnl MindSpore ships) on the same shapes, in this process on the cores it may
use: bf16 weights (LinearBlocks), int8 in groups (the hand-written VNNI kernel, LinearInt8) and int8
per channel (oneDNN's int8 matmul, `quant_group_size: -1`); ms per call, each path's speed over
sgemm's, per-channel int8 over bf16, and per-channel int8's largest error against an exact NumPy
reference of the same integers (it must stay at float32 rounding, ~1e-7, on every CPU).

    python -m tools.bench_int8_kernel [--shapes 576x1536,1536x576,576x3072] [--tokens 1,4,64,256]
                                      [--cores 1] [--calls 200] [--group 64]

Each time is the 10th percentile of --calls calls: on a shared VM a run's speed halves now and then,
and the fast calls show what the code does. Weights stay in cache between calls (a decode step
streams them from memory: tools/bench_agent.py measures that). The grouped int8 weights start on a
cache line, as the agent places them (agent.kernels.line_aligned), or --offset bytes past one: 16 or
32 bytes past one (where malloc and MindSpore's own Parameters start) made a call slower
(docs/perf-notes.md: every other 32-byte load spans two lines).
"""
from __future__ import annotations

import argparse
import ctypes as C
import os
import sys
import time
from pathlib import Path


import numpy as np


def _array_args(arrays: list[np.ndarray]) -> tuple:
    n = len(arrays)
    shapes = [(C.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    return (n, (C.c_void_p * n)(*[a.ctypes.data for a in arrays]), (C.c_int * n)(*[a.ndim for a in arrays]),
            (C.POINTER(C.c_int64) * n)(*[C.cast(s, C.POINTER(C.c_int64)) for s in shapes]),
            (C.c_char_p * n)(*[str(a.dtype).encode() for a in arrays]), None, None)


def _per_call(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[calls // 10]


def kernel_library() -> tuple[str, C.CDLL] | None:
    """The agent's native kernel library for this CPU (built on first use) and its path, or None
    (said why) when it cannot be built."""
    from agent.kernels import library

    os.environ.setdefault("LLM_SERVING_DEVICE", "CPU")
    path = library()
    if path is None:
        print("native kernels unavailable (no compiler, or LLM_SERVING_NATIVE=0)")
        return None
    return path, C.CDLL(path)


def channel_error(x: np.ndarray, rows, g: np.ndarray, y: np.ndarray) -> float:
    """Largest error of y against the per-channel recipe computed exactly (int64 sums, float64 scales),
    over the largest |reference|."""
    xg = x * g
    amax = np.abs(xg).max(1, keepdims=True)
    qx = np.rint(xg * np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)).astype(np.int64)
    ref = (qx @ rows.q.astype(np.int64).T) * rows.scale.T.astype(np.float64) * (amax.astype(np.float64) / 127)
    return float(np.abs(ref - y).max() / max(np.abs(ref).max(), 1e-30))


class Weights:
    """One K x N weight matrix in each path's layout: fp32 for sgemm, bf16 blocks, int8 in groups
    (`offset` bytes past a cache line), int8 per channel packed for oneDNN (None where this CPU
    refuses it: no VNNI or AMX)."""

    def __init__(self, w: np.ndarray, group: int, offset: int):
        from agent.kernels import CACHE_LINE, line_aligned, pack_int8_channel
        from agent.model.quant import CHANNEL, bf16_bits, quantize

        n, k = w.shape
        self.rows, self.wt = quantize(w, group), np.ascontiguousarray(w.T)
        self.qw = line_aligned((self.rows.q.size + CACHE_LINE,), np.int8)[offset % CACHE_LINE:][:self.rows.q.size]
        self.qw = self.qw.reshape(self.rows.q.shape)
        self.qw[...] = self.rows.q
        self.chan = quantize(w, CHANNEL)
        try:
            self.packed: np.ndarray | None = pack_int8_channel(self.chan.q)
        except RuntimeError:  # the kernels line above says why
            self.packed = None
        # linear_blocks.cpp's bf16 weights: 64-column blocks [N / 64, K, 64], N padded to whole blocks
        self.wb = np.ascontiguousarray(bf16_bits(np.pad(w, ((0, -n % 64), (0, 0)))).reshape(-1, 64, k).transpose(0, 2, 1))

    def row(self, lib: C.CDLL, dnnl: C.CDLL, x: np.ndarray, calls: int) -> str:
        """The table's columns for x [m, K]: sgemm's ms, each path's speed over it, the per-channel
        figures ("-" where refused)."""
        (m, k), n = x.shape, self.wt.shape[1]
        y = np.zeros((m, n), np.float32)
        g = np.ones(k, np.float32)  # named: the calls read it after _array_args returns
        yb = np.zeros((m, self.wb.shape[0] * 64), np.float32)
        args = {"bf16": (lib.LinearBlocks, [x, self.wb, yb]), "grp": (lib.LinearInt8, [x, self.qw, self.rows.scale, g, y])}
        if self.packed is not None:
            args["ch"] = (lib.LinearInt8, [x, self.packed, self.chan.scale, g, y])
        packed = {p: (fn, _array_args(arrays)) for p, (fn, arrays) in args.items()}
        t = {p: _per_call(lambda: fn(*a), calls) for p, (fn, a) in packed.items()}
        t["fp32"] = _per_call(lambda: dnnl.dnnl_sgemm(b"N", b"N", m, n, k, 1.0, x.ctypes.data, k, self.wt.ctypes.data, n,
                                                      0.0, y.ctypes.data, n), calls)
        out = f"{t['fp32'] * 1e3:>9.3f} ms" + "".join(f"{t['fp32'] / t[p]:>7.2f}x" + " " * (p == "grp")
                                                      for p in ("bf16", "grp"))
        if "ch" not in t:
            return out + f"{'-':>8}{'-':>10}{'-':>10}{'-':>10}"
        fn, a = packed["ch"]
        fn(*a)
        err = channel_error(x, self.chan, g, y)
        return out + f"{t['fp32'] / t['ch']:>7.2f}x{t['bf16'] / t['ch']:>10.2f}x{m * n * k / t['ch'] / 1e9:>10.1f}{err:>10.1e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="576x1536,1536x576,576x3072", help="K x N: inputs x outputs")
    ap.add_argument("--tokens", default="1,4,64,256")
    ap.add_argument("--cores", type=int, default=1, help="run on this many of the allowed cores")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--group", type=int, default=64, help="at most this many inputs per int8 scale (grouped path)")
    ap.add_argument("--offset", type=int, default=0, help="grouped weights start this many bytes past a cache line")
    args = ap.parse_args(argv)
    # Before the library loads: its worker pool sizes itself from this process's affinity.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])

    from agent.kernels import _dnnl_flags, kernel_paths
    from agent.model.quant import CHANNEL
    from common.cpu import describe

    found = kernel_library()
    if found is None:
        return 1
    path, lib = found
    dnnl = C.CDLL(str(Path(_dnnl_flags()[0][2:]) / "libdnnl.so.3"))
    dnnl.dnnl_sgemm.argtypes = [C.c_char, C.c_char, C.c_int64, C.c_int64, C.c_int64, C.c_float, C.c_void_p,
                                C.c_int64, C.c_void_p, C.c_int64, C.c_float, C.c_void_p, C.c_int64]
    print(f"CPU: {describe()}; {args.cores} core(s)")
    for dtype, group in (("bfloat16", 0), ("int8", 0), ("int8", CHANNEL)):
        print(kernel_paths(path, dtype, group))
    print(f"{'K x N':>12}{'tokens':>7}{'fp32 sgemm':>12}{'bf16':>8}{'int8 grp':>9}{'int8 ch':>8}"
          f"{'ch / bf16':>10}{'ch GMAC/s':>10}{'ch error':>10}")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((n, k)).astype(np.float32)
        weights = Weights(w, args.group, args.offset)
        for m in (int(t) for t in args.tokens.split(",")):
            print(f"{shape:>12}{m:>7}" + weights.row(lib, dnnl, rng.standard_normal((m, k)).astype(np.float32),
                                                      args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
