"""Weight blocks in fp32, bfloat16 and float16 (agent/kernels/linear_blocks.cpp through
agent.model.linear.F32Linear / Bf16Linear / F16Linear) and 16-bit KV
caches (kv_cache_dtype; agent/kernels/paged_attention.cpp reads them): every kernel path of this
CPU's build against float64 NumPy on the same bf16 values (the paths of the kinds below this CPU:
tools/test.sh runs this file again under LLM_SERVING_MAX_ISA); the tiny model against the float64
reference of its fp32 weights within the 16-bit tolerance, batch 1 equal to batch N, for bf16 and
f16 weights (KV auto = the same dtype) and for fp32 weights with a bf16 or fp16 cache (SmolLM2's
perplexity: test_smollm2_accuracy.py)."""
from __future__ import annotations

import numpy as np
import pytest

from agent import kernels
from agent.model.quant import bf16_bits
from agent.model.linear import Bf16Linear, F16Linear, F32Linear
from agent.model.params import WEIGHT_BLOCK
from common.cpu import cpu_flags
from tests.conftest import tiny_model_config
from tests.reference import reference_logits
from tests.agent.kernel_calls import call_kernel
from tests.agent.drivers import PROMPTS, PagedDriver, make_runner

# The kernels a CPU kind changes: run again as other kinds by tools/test.sh (LLM_SERVING_MAX_ISA).
pytestmark = pytest.mark.isa

# (rows, inputs, outputs): decode rows around the streaming loop's 4-row tiles, oneDNN's threshold
# (8 with AVX-512, 20 with AVX2), a packed step, a width that needs padding and several blocks per core.
CASES = [(1, 576, 960), (3, 100, 64), (5, 1536, 577), (8, 64, 192), (64, 576, 1536), (130, 96, 33)]
# bf16 rounds each weight and activation to 8 significant bits (relative error <= 2^-9 each).
BF16_REL = 2.0 ** -8


def as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def check_kernel(lib_path: str) -> str:
    """Runs every CASE through LinearBlocks of `lib_path` with fp32, bf16 and f16 weights; returns
    the paths the library reports."""
    import ctypes

    lib = ctypes.CDLL(lib_path)
    lib.Bf16KernelPath.restype = lib.F16KernelPath.restype = lib.F32KernelPath.restype = ctypes.c_char_p
    for cls in (F32Linear, Bf16Linear, F16Linear):
        for m, k, n in CASES:
            rng = np.random.default_rng(m * k + n)
            w = rng.standard_normal((n, k)).astype(np.float32)
            x = rng.standard_normal((m, k)).astype(np.float32) * 3
            (stored,) = cls.stored(w)
            y = np.zeros((m, stored.shape[0] * WEIGHT_BLOCK), np.float32)
            assert call_kernel(lib, "LinearBlocks", [x, stored, y]) == 0
            if cls is Bf16Linear:  # the kernel's own semantics: bf16 x and w, exact products, fp32 sums
                xh, wh = as_f32(bf16_bits(x)).astype(np.float64), as_f32(bf16_bits(w)).astype(np.float64)
            else:  # fp32 x; f16 or fp32 w
                xh, wh = x.astype(np.float64), cls.convert(w).astype(np.float64)
            want, scale = xh @ wh.T, np.abs(xh) @ np.abs(wh).T
            np.testing.assert_array_less(np.abs(y[:, :n] - want), 1e-5 * scale + 1e-6,
                                         err_msg=f"{cls.__name__} {m},{k},{n}")
            assert not y[:, n:].any()  # padded columns stay zero
    return " | ".join(getattr(lib, f)().decode() for f in ("F32KernelPath", "Bf16KernelPath", "F16KernelPath"))


def test_kernel_as_built_for_this_cpu():
    """The agent's build for this CPU (as LLM_SERVING_MAX_ISA caps it: tools/test.sh runs this as
    the kinds below the machine's). bf16 math on oneDNN where the CPU has AVX512-BF16 or AMX; on an
    AVX2-only CPU, the streaming loop in 256-bit vectors and, for many rows, weight tiles converted
    to fp32 for sgemm."""
    lib = kernels.library()
    assert lib is not None
    path = check_kernel(lib)
    has_bf16 = "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags()
    assert ("oneDNN bf16 matmul" in path) == has_bf16, path
    assert "f16: weights in f16" in path
    if "avx512f" not in cpu_flags():
        assert "streaming loop (AVX2" in path and "converted to fp32" in path, path


# (weights, KV cache, relative logit tolerance): bf16 rounds to 8 significant bits, fp16 to 11, an int8
# cache to 1/127 of each head row's largest value (measured within 2^-6 of the largest logit, not 2^-7).
# The plain MindSpore path (what other devices run) in float16: float16 MatMul outputs and a float16
# cache (measured 2^-9.5 of the largest logit on Zen 4; the native float16 path 2^-9.8).
VARIANTS = [("bfloat16", "auto", 8 * BF16_REL, True), ("float16", "auto", 2.0 ** -8, True),
            ("float32", "bfloat16", 8 * BF16_REL, True), ("float32", "float16", 2.0 ** -8, True),
            ("float32", "int8", 2.0 ** -6, True), ("float16", "auto", 2.0 ** -8, False)]


@pytest.fixture(scope="module", params=VARIANTS,
                ids=[f"{w}-weights-{kv}-kv{'' if native else '-plain'}" for w, kv, _, native in VARIANTS])
def bf16_runner(request, tiny_weights):
    dtype, kv, rel, native = request.param
    runner = make_runner(tiny_weights, 16, dtype=dtype, kv_dtype=kv, native=native)
    assert runner.kv_dtype == (dtype if kv == "auto" else kv)
    assert runner.model.k_cache[0].asnumpy().dtype == {"bfloat16": np.uint16, "float16": np.float16,
                                                        "int8": np.int8}[runner.kv_dtype]
    runner.rel_tol = rel
    return runner


def test_tiny_model_tracks_the_float64_reference(bf16_runner, tiny_weights):
    """Logits within the 16-bit error of the float64 forward of the fp32 weights (teacher-forced on
    the tokens the model chose), and each greedy token the reference's argmax wherever the
    reference's top two are further apart than that error."""
    seqs, logits = PagedDriver(bf16_runner).run(PROMPTS, 16)
    cfg = tiny_model_config()
    for prompt, seq, got in zip(PROMPTS, seqs, logits):
        want = reference_logits(cfg, tiny_weights, seq[:-1])[len(prompt) - 1:]
        err = np.abs(np.stack(got) - want).max(-1)
        tol = bf16_runner.rel_tol * np.abs(want).max(-1)  # measured: bf16 weights at most ~1.5 BF16_REL
        assert np.all(err <= tol), (err / np.abs(want).max(-1)).max()
        top2 = np.sort(want, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tol
        chosen = np.asarray(seq[len(prompt):])
        assert np.array_equal(chosen[clear], want.argmax(-1)[clear])
        assert clear.mean() > 0.5  # the check above is not vacuous


def test_batch_one_equals_batch_four(bf16_runner):
    """Every path rounds activations to bf16 the same way, so a row's tokens do not depend on its
    step's row count (decodes of 1 and of 4 rows, prefill alone or packed with others)."""
    batched, _ = PagedDriver(bf16_runner).run(PROMPTS, 12, collect_logits=False)
    for i, prompt in enumerate(PROMPTS):
        single, _ = PagedDriver(bf16_runner).run([prompt], 12, collect_logits=False)
        assert single[0] == batched[i]


def test_float16_cache_saturates_instead_of_overflowing():
    """A key or value past float16's range is stored as its largest finite value: an inf would make
    every score of that head NaN (float16 is the int8 models' default cache)."""
    import ctypes

    lib = ctypes.CDLL(kernels.library())
    hd = 8
    qkv = np.zeros((1, 3 * hd), np.float32)  # one query head, one KV head
    qkv[0, hd:2 * hd] = [1e6, -1e6, 1.5, 0, 0, 0, 0, 0]  # the key (cos 1, sin 0: written as is)
    qkv[0, 2 * hd:] = [-7e4, 7e4, 2.0, 0, 0, 0, 0, 0]  # the value
    cos, sin = np.ones((4, hd), np.float32), np.zeros((4, hd), np.float32)
    kc, vc = np.zeros((2, 1, hd), np.float16), np.zeros((2, 1, hd), np.float16)
    q = np.zeros((1, hd), np.float32)
    pro = np.zeros(3 * hd + 2 * hd + 4, np.float32)  # no bias, no q/k norm, no window
    pro[-1] = 4  # rope: the tables' 4 rows (agent/kernels/prologue.h)
    assert call_kernel(lib, "RopeCache", [qkv, cos, sin, np.zeros(1, np.int32), np.ones(1, np.int32), kc, vc, pro, q]) == 0
    assert kc[1, 0, :3].tolist() == [65504, -65504, 1.5] and vc[1, 0, :3].tolist() == [-65504, 65504, 2.0]


def test_16_bit_kv_without_native_kernels_is_refused_clearly():
    from agent.model.backend import Backend

    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs the native kernels"):
        Backend("float32", None, "bfloat16")
