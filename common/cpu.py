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


# LLM_SERVING_MAX_ISA: run another CPU kind's paths on this one. Each level: the flags it takes away
# (a name ending in "*" takes every flag it begins), the compiler's switches that take the
# same from -march=native, and oneDNN's own cap (ONEDNN_MAX_CPU_ISA). The levels are the kinds seen:
# avx2 = AMD Zen 3; avx512 = Skylake-X class; avx512_vnni = AMD Zen 4 and Xeons without AMX (VNNI and
# BF16, no FP16 or AVX-VNNI); amx = Sapphire Rapids class, every path (no cap).
ISA_ENV = "LLM_SERVING_MAX_ISA"
_AMX = ("amx_*",)
_AMX_OFF = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
ISA_LEVELS: dict[str, tuple[tuple[str, ...], list[str], str | None]] = {
    "avx2": (("avx512*", "avx_vnni", *_AMX), ["-mno-avx512f", "-mno-avxvnni", *_AMX_OFF], "AVX2"),
    "avx512": (("avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", *_AMX),
               ["-mno-avx512vnni", "-mno-avx512bf16", "-mno-avx512fp16", "-mno-avxvnni", *_AMX_OFF], "AVX512_CORE"),
    "avx512_vnni": (("avx512_fp16", "avx_vnni", *_AMX), ["-mno-avx512fp16", "-mno-avxvnni", *_AMX_OFF],
                    "AVX512_CORE_BF16"),
    "amx": ((), [], None),
}


def isa_cap() -> str | None:
    """The level LLM_SERVING_MAX_ISA names (None: this CPU as it is); any other value is refused."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_LEVELS)}")
    return value


def apply_isa_cap() -> str | None:
    """Caps oneDNN like our kernels (it reads ONEDNN_MAX_CPU_ISA at its first dispatch, so this runs
    before any model is built; one the user set is kept). Returns the cap."""
    cap = isa_cap()
    onednn = ISA_LEVELS[cap][2] if cap else None
    if onednn:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    return cap


def compiler_isa_flags() -> list[str]:
    """What the native kernels' build adds to -march=native under the cap."""
    cap = isa_cap()
    return list(ISA_LEVELS[cap][1]) if cap else []


def _taken(flag: str, patterns: tuple[str, ...]) -> bool:
    return any(flag.startswith(p[:-1]) if p.endswith("*") else flag == p for p in patterns)


def native_flags() -> set[str]:
    """The CPU's own flags, uncapped."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def capped(flags: set[str], cap: str | None) -> set[str]:
    """`flags` less what the level `cap` takes away."""
    return {f for f in flags if not _taken(f, ISA_LEVELS[cap][0])} if cap else set(flags)


def cpu_flags() -> set[str]:
    """The flags every decision reads (kernel paths, int8 recipe, the tests' gates): the CPU's, less
    what LLM_SERVING_MAX_ISA takes away."""
    return capped(native_flags(), isa_cap())


def describe() -> str:
    """e.g. "AMD EPYC (2 cores; avx2 fma avx512f ... avx512_vnni avx512_bf16; no amx_tile amx_int8 amx_bf16)"."""
    name = platform.processor() or "unknown CPU"
    try:
        name = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    have, cap = cpu_flags(), isa_cap()
    yes, no = [f for f in FLAGS if f in have], [f for f in FLAGS if f not in have]
    if cap and have == native_flags():  # a cap above this CPU: nothing is taken, nothing is added
        capping = f"; {ISA_ENV}={cap} caps nothing here: this CPU has no more than that)"
    else:
        capping = f"; capped at {cap} by {ISA_ENV})" if cap else ")"
    return f"{name} ({os.cpu_count()} cores; {' '.join(yes) or 'none of ' + ' '.join(FLAGS)}" + (
        f"; no {' '.join(no)}" if no else "") + capping


def read_bandwidth(threads: int, size: int = 1 << 30) -> float:
    """Bytes/s that `threads` threads read from memory, each reducing its share of a `size`-byte
    buffer (numpy releases the GIL): a decode step reads every streamed weight once, at best at
    this speed. A copy would count half its traffic."""
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


# The kinds seen besides the AMX Xeons, slowest first: the levels tools/test.sh runs the `isa` tests at.
SEEN_KINDS = ("avx2", "avx512_vnni")


def kinds_below(flags: set[str]) -> list[str]:
    """The seen kinds whose paths a CPU with `flags` runs only under the cap (they take something away)."""
    return [level for level in SEEN_KINDS if capped(flags, level) != flags]


if __name__ == "__main__":
    import sys

    print(" ".join(kinds_below(cpu_flags())) if sys.argv[1:] == ["--kinds-below"] else describe())
