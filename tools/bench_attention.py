"""Decode attention (agent/kernels/paged_attention.cpp's PagedAttention, as the agent builds it for
this CPU) over a written, paged KV cache: one call per layer, as a decode step makes them, so the
cache comes from memory as in serving. Prints ms per step (all layers), the GB/s of keys and values
that makes, the same calls with every layer on one layer's cache (in cache: the compute's share),
and the read bandwidth of the same cores.

    python -m tools.bench_attention [--rows 64] [--context 192] [--kv-dtype float16] [--layers 30]

The shape defaults to SmolLM2's (9 query heads on 3 KV heads of 64); a sequence's blocks of 16
slots interleave with the other rows' (as the server allocates them while every row grows). The
cache is written first: an untouched cache is one zero page, always in cache, and measured 2-3x
faster than the same calls on a written one (Zen 4). Each time is the median of --calls steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


import numpy as np

from tools.bench_int8_kernel import _array_args, kernel_library

BLOCK = 16
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8}  # bfloat16 as its bits


def _cache(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = rng.standard_normal(shape, np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    if dtype == "int8":  # each head's values, then its float32 scale (as RopeCache writes them)
        return int8_rows(values)
    return values.astype(DTYPES[dtype])


def int8_rows(x: np.ndarray) -> np.ndarray:
    """[..., hd] float32 -> [..., hd + 4] int8: values rounded to max|x| / 127 steps, then the scale."""
    amax = np.abs(x).max(-1, keepdims=True)
    scale = (amax / 127).astype(np.float32)
    q = np.rint(x * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0)).astype(np.int8)
    return np.concatenate([q, scale.view(np.int8)], -1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="decode rows (sequences) a step")
    ap.add_argument("--context", type=int, default=192, help="keys each row attends over")
    ap.add_argument("--kv-dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args(argv)

    from common.cpu import describe, read_bandwidth

    found = kernel_library()
    if found is None:
        return 1
    lib = found[1]
    r, ctx, hd = args.rows, args.context, args.head_dim
    blocks = -(-ctx // BLOCK)
    slots_n = (1 + blocks * r) * BLOCK  # block 0 stays reserved, as in the agent
    rng = np.random.default_rng(0)
    k_cache = _cache(rng, (args.layers, slots_n, args.kv_heads, hd), args.kv_dtype)  # [..., hd (+ 4)]
    v_cache = _cache(rng, (args.layers, slots_n, args.kv_heads, hd), args.kv_dtype)
    q = (rng.standard_normal((r, args.heads * hd), np.float32) / np.sqrt(hd)).astype(np.float32)
    pos = np.arange(ctx)
    # Row i's block b is block 1 + b * rows + i: every row's blocks interleave with the others'.
    ctx_slots = ((1 + (pos // BLOCK)[None, :] * r + np.arange(r)[:, None]) * BLOCK + pos % BLOCK).astype(np.int32)
    token_rows = np.arange(r, dtype=np.int32)
    positions = np.full(r, ctx - 1, np.int32)
    out = np.zeros_like(q)
    calls = [_array_args([q, k_cache[i], v_cache[i], ctx_slots, token_rows, positions, out])
             for i in range(args.layers)]
    same = [calls[0]] * args.layers

    def step_ms(layer_calls: list[tuple]) -> float:
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            for c in layer_calls:
                if lib.PagedAttention(*c):
                    raise RuntimeError("PagedAttention refused its inputs")
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {describe()}; {cores} core(s)")
    print(f"{r} rows x {ctx} keys, {args.heads} heads on {args.kv_heads} KV heads of {hd}, {args.kv_dtype} cache, "
          f"{args.layers} layers ({k_cache.nbytes * 2 / 2**20:.0f} MiB of K + V)")
    read = r * ctx * args.kv_heads * k_cache.shape[-1] * k_cache.itemsize * 2 * args.layers
    step_ms(calls)  # first touch of the outputs and the kernel's thread-local buffers
    from_memory, in_cache = step_ms(calls), step_ms(same)
    bw = read_bandwidth(cores)
    print(f"from memory {from_memory:8.2f} ms a step  {read / from_memory / 1e6:6.1f} GB/s of K + V")
    print(f"in cache    {in_cache:8.2f} ms a step  (one layer's cache {args.layers} times)")
    print(f"read bandwidth of {cores} core(s) {bw / 1e9:.1f} GB/s: the step's K + V at that speed take "
          f"{read / bw * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
