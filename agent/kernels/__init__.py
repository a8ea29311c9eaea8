"""Native CPU kernels (MindSpore AOT custom ops), compiled on first use for the host's CPU.

Only what MindSpore CPU cannot express in few fast kernels lives here: the projections run on
oneDNN from the libdnnl MindSpore itself ships (fp32 sgemm, bf16 matmul: faster than its MatMul,
and one weight layout serves every batch size); int8 is hand-written (oneDNN 3.10's int8 matmul has
no per-group input scales, which the accuracy recipe needs: agent/kernels/linear_int8.cpp); paged attention reads K/V straight from the flat cache by slot,
where the pure-MindSpore path gathers a copy of every row's context and runs ~8 kernels per
layer; RMSNorm, rope and SwiGLU run as one op each instead of 4-5 small kernels, each of which
costs tens of microseconds of dispatch. Without a C++ compiler, or with LLM_SERVING_NATIVE=0, the
model keeps the pure-MindSpore path (same results).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from common.cpu import ISA_ENV, apply_isa_cap, compiler_isa_flags

log = logging.getLogger("llm_serving.agent")
KERNEL_DIR = Path(__file__).parent
# -ffast-math's parts, not the flag itself: linking a shared library with -ffast-math (or
# -funsafe-math-optimizations) adds crtfastmath.o (GCC 12), whose constructor turns on
# flush-to-zero in whatever process loads the library (a test process that had loaded it saw every
# later subnormal float become 0).
FAST_MATH = ["-fno-math-errno", "-fassociative-math", "-freciprocal-math", "-ffinite-math-only", "-fno-signed-zeros",
             "-fno-trapping-math", "-fcx-limited-range"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-std=c++17", "-shared", "-fPIC", "-pthread"]


CACHE_LINE = 64


HUGE_PAGE = 2 << 20
# Arrays from this size on (stacked weights, the LM head, the KV caches) get huge pages; a smaller
# one would hold a whole 2 MiB page for less than 16 MiB (at most 1/8 more memory).
HUGE_MIN_BYTES = 8 * HUGE_PAGE


def line_aligned(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """Zeros (lazily: pages are touched on first write) starting on a cache line: the kernels'
    weight rows are multiples of 64 bytes, and 16 bytes past a line (where malloc, and MindSpore's
    Parameter copy, start) every other 32-byte load of a row spans two lines, and the kernels ran
    slower so (docs/perf-notes.md).

    Large arrays start on a 2 MiB boundary of their own private mapping, advised MADV_HUGEPAGE:
    where transparent huge pages are 'madvise' (the common default) or 'always', a decode step's
    weight stream then crosses a page (a TLB miss, and the hardware prefetcher stops) every 2 MiB,
    not every 4 KiB (docs/perf-notes.md). LLM_SERVING_HUGE_PAGES=0 turns it off."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("LLM_SERVING_HUGE_PAGES") != "0":
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        raw, align = np.frombuffer(region, np.uint8), HUGE_PAGE  # the array keeps the mapping alive
    else:
        raw, align = np.zeros(nbytes + CACHE_LINE, np.uint8), CACHE_LINE
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def enabled() -> bool:
    return os.environ.get("LLM_SERVING_NATIVE", "1") != "0" and os.environ.get("LLM_SERVING_DEVICE", "CPU") == "CPU"


def _sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cpp")) + sorted(KERNEL_DIR.glob("*.h"))


def sources_digest() -> str:
    """Changes with the kernels' source, the switch and the ISA cap (the graphs name the library
    built under it): part of the graph compile-cache key."""
    h = hashlib.sha1(f"{enabled()}{compiler_isa_flags()}".encode())
    for src in _sources():
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def _dnnl_flags() -> list[str]:
    """Link against MindSpore's own oneDNN (libmindspore_cpu links it, so it is always there)."""
    spec = importlib.util.find_spec("mindspore")
    lib_dir = Path(spec.origin).parent / "lib" if spec and spec.origin else Path()
    return [f"-L{lib_dir}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib_dir}"]


def _cpu_signature() -> str:
    """-march=native code must not be reused on another CPU (a moved home directory, a shared cache)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def library() -> str | None:
    """Path of the kernel library built from agent/kernels/*.cpp, compiled once per source,
    compiler flags and CPU; None when native kernels are off or cannot be built."""
    if not enabled():
        if os.environ.get("LLM_SERVING_NATIVE", "1") == "0":
            log.warning("native kernels off (LLM_SERVING_NATIVE=0): plain MindSpore ops, slower, same results")
        else:
            log.info("native kernels off: they are CPU kernels and the device is %s", os.environ["LLM_SERVING_DEVICE"])
        return None
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        log.warning("no C++ compiler (%s): native kernels off, plain MindSpore ops", cxx)
        return None
    apply_isa_cap()
    srcs = sorted(KERNEL_DIR.glob("*.cpp"))
    link = _dnnl_flags()
    flags = [*FLAGS, *compiler_isa_flags()]  # the cap's -mno-* after -march=native
    key = hashlib.sha1(b"".join(s.read_bytes() for s in _sources())
                       + " ".join([cxx, *flags, *link, _cpu_signature()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-serving" / "kernels"
    out = cache / f"kernels-{key}.so"
    if out.exists():
        return str(out)
    cache.mkdir(parents=True, exist_ok=True)
    # Agents start together: each builds into its own file and renames, so none loads a half-written one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        _build(cxx, flags, srcs, link, tmp)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as e:
        log.warning("building native kernels failed, pure-MindSpore path used:\n%s", e.stderr[-2000:])
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


def _build(cxx: str, flags: list[str], srcs: list[Path], link: list[str], out: str) -> None:
    """Each source compiled on its own core, then linked: a first start's build takes about half
    the one-core time on two cores (docs/perf-notes.md)."""
    def compile_one(src: Path) -> str:
        obj = os.path.join(objs, src.stem + ".o")
        subprocess.run([cxx, *[f for f in flags if f != "-shared"], "-c", str(src), "-o", obj], check=True,
                       capture_output=True, text=True)
        return obj

    by_size = sorted(srcs, key=lambda p: p.stat().st_size, reverse=True)  # the longest compiles start first
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as objs, \
            ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        objects = list(pool.map(compile_one, by_size))
        subprocess.run([cxx, *flags, "-o", out, *objects, *link], check=True, capture_output=True, text=True)


def kernel_paths(lib: str | None, dtype: str, int8_group: int = 0, deterministic: bool = False) -> str:
    """The path the projections of `dtype` take with this build on this CPU (int8 per channel where
    `int8_group` is -1: the implementation oneDNN picked), and what batch invariance changes."""
    if lib is None:
        return "plain MindSpore ops (native kernels off)"
    cap = apply_isa_cap()
    cdll = ctypes.CDLL(lib)
    fixed = ""
    if deterministic:
        cdll.DeterministicPath.restype = ctypes.c_char_p
        fixed = "; " + cdll.DeterministicPath().decode()
    return (f"{ISA_ENV}={cap}: " if cap else "") + _paths(cdll, dtype, int8_group) + fixed


def deterministic_switch(lib: str) -> Callable[[int], None]:
    """The kernels' batch-invariance switch (serving_config.deterministic; agent/kernels/deterministic.h):
    one per process, which a runner sets before each of its graph calls."""
    return ctypes.CDLL(lib).SetDeterministic


def _paths(cdll: ctypes.CDLL, dtype: str, int8_group: int) -> str:
    def path(name: str) -> str:
        fn = getattr(cdll, name)
        fn.restype = ctypes.c_char_p
        return fn().decode()

    if dtype == "int8" and int8_group == -1:  # the down projection keeps groups (agent.model.fusion.kind_group)
        return f"{path('Int8ChannelKernelPath')}; down projection in groups: {path('Int8KernelPath')}"
    if dtype == "gguf":
        return path("GgufKernelPath")
    return path({"int8": "Int8KernelPath", "bfloat16": "Bf16KernelPath", "float16": "F16KernelPath",
                 "float32": "F32KernelPath"}[dtype])


def custom_ops(lib: str, tp_size: int = 1) -> dict[str, Any]:
    """The kernels as MindSpore AOT custom ops, by name: the projections (fp32, bf16 or f16 weight
    blocks; int8), alone or fused with what feeds them: the norm, SwiGLU, or the layer's attention
    (rope writing the step's keys and values into the cache, then paged attention reading it by
    slot); every decoder layer as one op; RMSNorm / SwiGLU / a gained RMSNorm each as one op instead of 4-5; the tensor-parallel collectives over
    shared memory (`tp_size` ranks)."""
    from mindspore import ops
    from mindspore.common import dtype as mstype

    def custom(name: str, out_shape: Any, out_dtype: Any) -> Any:
        return ops.Custom(f"{lib}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")

    def writes_memory(op: Any) -> Any:
        """An op that writes one of its inputs (a KV cache Parameter) in place: MindSpore then orders
        that Parameter's later reads after it, as it does for its own ScatterUpdate."""
        op.add_prim_attr("side_effect_mem", True)
        return op

    same = lambda x, *_: x  # noqa: E731
    pair = lambda x, *_: (x, x)  # noqa: E731
    return {
        "linear_blocks": custom("LinearBlocks", lambda x, w: [x[0], w[0] * w[2]], same),
        "add_rms_linear": custom("AddRmsLinear", lambda x, d, e, w: (x, [x[0], w[0] * w[2]]), pair),
        "swiglu_linear": custom("SwiGluLinear", lambda gu, c, w: [gu[0], w[0] * w[2]], same),
        # sw [N, groups]; with LoRA, A [E, K] after g (then each token's slot): E columns more
        "linear_i8": custom("LinearInt8", lambda x, w, sw, *a: [x[0], sw[0] + _rows(a[1:])], same),
        "add_rms_linear_i8": custom("AddRmsLinearInt8", lambda x, d, e, w, sw, *a: (x, [x[0], sw[0] + _rows(a[1:])]),
                                    pair),
        "swiglu_linear_i8": custom("SwiGluLinearInt8", lambda gu, c, w, sw, *a: [gu[0], sw[0] + _rows(a[1:])], same),
        # GGUF blocks as stored (linear_gguf.cpp): w, seg, rs [N], g after the inputs
        "linear_gguf": custom("LinearGguf", lambda x, w, seg, rs, g: [x[0], rs[0]], same),
        "add_rms_linear_gguf": custom("AddRmsLinearGguf", lambda x, d, e, w, seg, rs, g: (x, [x[0], rs[0]]), pair),
        "swiglu_linear_gguf": custom("SwiGluLinearGguf", lambda gu, c, w, seg, rs, g: [gu[0], rs[0]], same),
        "rope_attention_linear_gguf": writes_memory(custom("RopeAttentionLinearGguf",
                                                           lambda qkv, *a: [qkv[0], a[11][0]], same)),
        "embed_gguf": custom("EmbedGguf", lambda t, w, seg, scale: [t[0], scale[0]], lambda *_: mstype.float32),
        "rms": custom("RmsNorm", same, same),
        "add_rms": custom("AddRmsNorm", pair, pair),
        "swiglu": custom("SwiGlu", lambda gu, c: [gu[0], gu[1] // 2], same),
        "rms_gain": custom("RmsGain", same, same),
        "logsumexp": custom("LogSumExp", lambda x: [x[0]], same),
        # inputs: qkv, cos, sin, positions, slots, k_cache, v_cache, context slots, token rows, prologue, the weights
        "rope_attention_linear": writes_memory(custom("RopeAttentionLinear", lambda qkv, *a: [qkv[0], a[9][0] * a[9][2]],
                                                      same)),
        "rope_attention_linear_i8": writes_memory(custom("RopeAttentionLinearInt8",
                                                         lambda qkv, *a: [qkv[0], a[10][0] + _rows(a[12:])], same)),
        # inputs: x, the attention's shared 6, eps, the K and V caches, the prologues, each kind's weights: every
        # layer's stacked
        "decoder_stack": writes_memory(custom("DecoderStack", same, same)),
        "decoder_stack_i8": writes_memory(custom("DecoderStackInt8", same, same)),
        "all_reduce": custom("AllReduce", same, same),
        "all_gather": custom("AllGather", lambda x: [x[0], x[1] * tp_size], same),
    }


def _rows(shrink: tuple) -> int:
    """The columns an int8 op's optional LoRA A input [E, K] adds to its output (none: 0)."""
    return shrink[0][0] if shrink else 0


def pack_int8_channel(q: np.ndarray) -> np.ndarray:
    """int8 rows [N, K] (one scale per row) -> the bytes oneDNN's int8 matmul reads them from on this
    CPU (agent/kernels/int8_channel.cpp), line-aligned."""
    lib = library()
    if lib is None:
        raise RuntimeError("int8 per-channel weights need the native kernels (a C++ compiler, LLM_SERVING_NATIVE=1)")
    cdll = ctypes.CDLL(lib)
    n, k = q.shape
    cdll.Int8ChannelBytes.restype = ctypes.c_int64
    size = cdll.Int8ChannelBytes(ctypes.c_int64(k), ctypes.c_int64(n))
    if size <= 0:
        cdll.Int8ChannelKernelPath.restype = ctypes.c_char_p
        raise RuntimeError(f"quant_group_size -1 cannot run on this CPU: {cdll.Int8ChannelKernelPath().decode()}; "
                           "use a group size (the default, 72)")
    rows = np.ascontiguousarray(q, np.int8)
    out = line_aligned((size,), np.int8)
    if cdll.Int8ChannelPack(ctypes.c_int64(k), ctypes.c_int64(n), ctypes.c_void_p(rows.ctypes.data),
                            ctypes.c_void_p(out.ctypes.data)):
        raise RuntimeError(f"packing int8 weights [{k}, {n}] for oneDNN failed")
    return out
