"""The agent's memory against the step lengths it sees: oneDNN primitives are built and kept per row
count (agent/kernels/linear_blocks.cpp, int8_channel.cpp), so every new count costs memory. Runs
one decoder layer's projections (SmolLM2's shapes) at random row counts, first rounded to the decoder
stack's row buckets (dnnl.h's row_bucket, as serving does), then at every count as they come (as
serving did before issue 68), and prints the primitives kept and the process's RSS growth after each
phase: the first plateaus, the second grows with every count it has not seen.

    python -m tools.kernel_memory [--dtype float32] [--calls 800] [--max-rows 512]

A standalone reproduction: it loads the kernel library and oneDNN only (no MindSpore graph).
"""
from __future__ import annotations

import argparse
import ctypes as C

import numpy as np

from common.cpu import describe
from tools.bench_int8_kernel import _array_args, kernel_library

NB = 64
HIDDEN, QKV, GATE_UP, INTER = 576, 960, 3072, 1536  # SmolLM2-135M
WEIGHTS = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def layer_weights(dtype: str) -> list[np.ndarray]:
    """[blocks, k, 64] weight blocks of the layer's four projections (values do not matter here)."""
    shapes = [(QKV // NB, HIDDEN), (HIDDEN // NB, HIDDEN), (GATE_UP // NB, HIDDEN), (HIDDEN // NB, INTER)]
    return [np.full((blocks, k, NB), 0.01, np.float32).astype(WEIGHTS[dtype]) for blocks, k in shapes]


def run_phase(lib: C.CDLL, weights: list[np.ndarray], lengths: list[int]) -> None:
    for m in lengths:
        for w in weights:
            x = np.ones((m, w.shape[1]), np.float32)
            y = np.empty((m, w.shape[0] * NB), np.float32)
            if lib.LinearBlocks(*_array_args([x, w, y])):
                raise RuntimeError(f"LinearBlocks failed at {m} rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=sorted(WEIGHTS))
    ap.add_argument("--calls", type=int, default=800, help="step lengths drawn in each phase")
    ap.add_argument("--max-rows", type=int, default=512, help="the longest step (the step token budget)")
    args = ap.parse_args()
    found = kernel_library()
    if found is None:
        return
    _, lib = found
    lib.RowBucket.restype = lib.OnednnPrimitives.restype = C.c_int64
    lib.RowBucket.argtypes = [C.c_int64]
    weights = layer_weights(args.dtype)
    rng = np.random.default_rng(0)
    print(f"{describe()}: {args.dtype}, {args.calls} steps a phase, 1..{args.max_rows} rows")
    run_phase(lib, weights, [1, args.max_rows])  # the library's own buffers, before the baseline
    base_rss, base_kept = rss_mib(), lib.OnednnPrimitives()
    print(f"{'phase':<22}{'row counts':>11}{'primitives':>11}{'RSS +MiB':>10}")
    phases = [("row buckets", lambda m: lib.RowBucket(m)), ("every count", lambda m: m)]
    for name, rows in phases:
        lengths = [int(rows(int(m))) for m in rng.integers(1, args.max_rows + 1, args.calls)]
        for half in (lengths[:len(lengths) // 2], lengths[len(lengths) // 2:]):
            run_phase(lib, weights, half)
            print(f"{name:<22}{len(set(lengths)):>11}{lib.OnednnPrimitives() - base_kept:>11}"
                  f"{rss_mib() - base_rss:>10.1f}")


if __name__ == "__main__":
    main()
