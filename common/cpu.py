"""The CPU as benchmarks name it: model, cores, the instruction sets the kernels can use, and the
memory bandwidth its cores reach (what bounds a decode step)."""
from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

# What decides the kernel paths (agent/kernels): vector width, int8 dot products, bf16, AMX.
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx_vnni", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> set[str]:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def describe() -> str:
    """e.g. "AMD EPYC (2 cores; avx2 fma avx512f ... avx512_vnni avx512_bf16; no amx_tile amx_int8 amx_bf16)"."""
    name = platform.processor() or "unknown CPU"
    try:
        name = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    have = cpu_flags()
    yes, no = [f for f in FLAGS if f in have], [f for f in FLAGS if f not in have]
    return f"{name} ({os.cpu_count()} cores; {' '.join(yes) or 'none of ' + ' '.join(FLAGS)}" + (
        f"; no {' '.join(no)})" if no else ")")


def read_bandwidth(threads: int, size: int = 1 << 30) -> float:
    """Bytes/s that `threads` threads read from memory, each reducing its share of a `size`-byte
    buffer (numpy releases the GIL): a decode step reads every streamed weight once, at best at
    this speed. A copy would count half its traffic (measured here: 24 GB/s copied, 35 read)."""
    src = np.ones(size // 4, np.float32)
    parts = np.array_split(src, threads)
    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return size / best
