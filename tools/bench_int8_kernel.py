"""One int8 projection (agent/kernels/linear_int8.cpp's LinearInt8, as the agent builds it for this
CPU) against oneDNN's fp32 sgemm (the libdnnl MindSpore ships) on the same shapes, in this process
on the cores it may use: ms per call, the ratio and int8's GMAC/s.

    python tools/bench_int8_kernel.py [--shapes 576x1536,1536x576,576x3072] [--tokens 1,4,64,256]
                                      [--cores 1] [--calls 200] [--group 64]

Each time is the 10th percentile of --calls calls: on a shared VM a run's speed halves now and then,
and the fast calls show what the code does. Weights stay in cache between calls (a decode step
streams them from memory: tools/bench_agent.py measures that). The weights start on a cache line, as
the agent places them (agent.kernels.line_aligned), or --offset bytes past one: 16 or 32 bytes
past one (where malloc and MindSpore's own Parameters start) made a call 1.09-1.29x slower on a
Zen 4 (every other 32-byte load spans two lines). Each row prints the offset it ran with.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="576x1536,1536x576,576x3072", help="K x N: inputs x outputs")
    ap.add_argument("--tokens", default="1,4,64,256")
    ap.add_argument("--cores", type=int, default=1, help="run on this many of the allowed cores")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--group", type=int, default=64, help="at most this many inputs per int8 scale")
    ap.add_argument("--offset", type=int, default=0, help="weights start this many bytes past a cache line")
    args = ap.parse_args(argv)
    # Before the library loads: its worker pool sizes itself from this process's affinity.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])

    from agent.kernels import CACHE_LINE, _dnnl_flags, kernel_paths, line_aligned
    from agent.quant import quantize
    from common.cpu import describe

    found = kernel_library()
    if found is None:
        return 1
    path, lib = found
    dnnl = C.CDLL(str(Path(_dnnl_flags()[0][2:]) / "libdnnl.so.3"))
    dnnl.dnnl_sgemm.argtypes = [C.c_char, C.c_char, C.c_int64, C.c_int64, C.c_int64, C.c_float, C.c_void_p,
                                C.c_int64, C.c_void_p, C.c_int64, C.c_float, C.c_void_p, C.c_int64]
    print(f"CPU: {describe()}; {args.cores} core(s)")
    print(kernel_paths(path, "int8"))
    print(f"{'K x N':>12}{'tokens':>8}{'fp32 sgemm':>13}{'int8':>11}{'ratio':>8}{'int8 GMAC/s':>13}"
          f"{'weights % 64':>14}")
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((n, k)).astype(np.float32)
        rows, wt = quantize(w, args.group), np.ascontiguousarray(w.T)
        qw = line_aligned((rows.q.size + CACHE_LINE,), np.int8)[args.offset % CACHE_LINE:][:rows.q.size]
        qw = qw.reshape(rows.q.shape)
        qw[...] = rows.q
        for m in (int(t) for t in args.tokens.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.zeros((m, n), np.float32)
            g = np.ones(k, np.float32)  # named: the call reads it after _array_args returns
            call = _array_args([x, qw, rows.scale, g, y])
            int8 = _per_call(lambda: lib.LinearInt8(*call), args.calls)
            fp32 = _per_call(lambda: dnnl.dnnl_sgemm(b"N", b"N", m, n, k, 1.0, x.ctypes.data, k, wt.ctypes.data, n,
                                                     0.0, y.ctypes.data, n), args.calls)
            print(f"{shape:>12}{m:>8}{fp32 * 1e3:>10.3f} ms{int8 * 1e3:>8.3f} ms{fp32 / int8:>7.2f}x"
                  f"{m * n * k / int8 / 1e9:>13.1f}{qw.ctypes.data % CACHE_LINE:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
