"""Native CPU kernels: the paged-attention and oneDNN projection ops vs float64 NumPy (the fallback
when they cannot be built: test_kernel_build.py). (RMSNorm / rope / SwiGLU are checked through the whole model in
test_model_runner, with and without native kernels, against the NumPy reference.)"""
from __future__ import annotations

import numpy as np
import pytest

from agent import kernels as native
from agent.graph_call import setup_mindspore
from tools.bench_attention import int8_rows

# The kernels a CPU kind changes: run again as other kinds by tools/test.sh (LLM_SERVING_MAX_ISA).
pytestmark = pytest.mark.isa


def dequantized(rows: np.ndarray) -> np.ndarray:
    """An int8 cache [..., hd + 4] (values, then their float32 scale) as float64 [..., hd]."""
    return rows[..., :-4].astype(np.float64) * rows[..., -4:].copy().view(np.float32).astype(np.float64)


def reference(q, kc, vc, slots, token_rows, pos, window=0):
    if kc.dtype == np.int8:
        kc, vc = dequantized(kc), dequantized(vc)
    n, width = q.shape
    kv, hd = kc.shape[1:]
    heads = width // hd
    out = np.zeros((n, width))
    for row in range(n):
        ctx = slots[token_rows[row], max(0, pos[row] + 1 - window) if window else 0:pos[row] + 1]
        for h in range(heads):
            k = kc[ctx, h // (heads // kv)].astype(np.float64)
            v = vc[ctx, h // (heads // kv)].astype(np.float64)
            s = k @ q[row, h * hd:(h + 1) * hd]
            p = np.exp(s - s.max())
            out[row, h * hd:(h + 1) * hd] = (p / p.sum()) @ v
    return out


# Query tokens per sequence of one packed step: decodes (1), short runs (< 8: per-token path) and
# prefill chunks (GEMM path), mixed in any order.
# One decode token alone: its KV heads are split over the cores (with two or more), or, where they
# do not divide evenly and the context is long, its keys (partial softmaxes merged).
@pytest.mark.parametrize("heads,kv,hd,q_lens,ctx", [
    (9, 3, 64, [1] * 5, 48), (4, 4, 128, [1] * 5, 48), (4, 2, 16, [1] * 5, 48), (6, 2, 64, [3] * 5, 48),
    (9, 3, 64, [40] * 5, 48), (4, 4, 16, [8] * 5, 48), (9, 3, 64, [1, 40, 1, 3, 9], 48),
    (4, 2, 16, [33, 1, 1, 8, 2], 48), (9, 3, 64, [1], 48), (4, 4, 128, [1], 48), (9, 3, 64, [1], 300),
    (8, 1, 128, [1], 517), (10, 2, 64, [1] * 5, 48)],
    ids=["gqa-hd64", "mha-hd128", "generic-hd16", "multi-query-rows", "prefill-gemm-gqa", "prefill-gemm-mha-hd16",
         "packed-mix-gqa", "packed-mix-hd16", "one-decode-token-gqa", "one-decode-token-mha-hd128",
         "one-decode-token-long-context-keys-split", "one-decode-token-one-kv-head-hd128-keys-split",
         "gqa-5-heads-a-kv-head"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_kernel_matches_numpy(heads, kv, hd, q_lens, ctx, kv_dtype, window=0):
    """Every path, over a float32 cache and over an int8 one (rows of values and their scale, as
    RopeCache writes them: the reference reads the same rows dequantized)."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    setup_mindspore()
    lib = native.library()
    assert lib is not None

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = ops.Custom(f"{lib}:PagedAttention", out_shape=lambda q, *_: q,
                                 out_dtype=lambda q, *_: q, func_type="aot")

        def construct(self, *args):
            return self.op(*args)

    rng = np.random.default_rng(hd + sum(q_lens))
    seqs, n_slots = len(q_lens), 1024
    token_rows = np.repeat(np.arange(seqs), q_lens).astype(np.int32)
    kc = rng.standard_normal((n_slots, kv, hd), dtype=np.float32)
    vc = rng.standard_normal((n_slots, kv, hd), dtype=np.float32)
    if kv_dtype == "int8":
        kc, vc = int8_rows(kc), int8_rows(vc)
    # Scattered, non-contiguous slots per sequence, as paged blocks are.
    slots = np.stack([rng.permutation(n_slots)[:ctx] for _ in range(seqs)]).astype(np.int32)
    # Context lengths 1..ctx, including lengths that are not a multiple of the kernel's key block.
    n = len(token_rows)
    pos = rng.integers(0, ctx, n).astype(np.int32)
    pos[:3] = [ctx - 1, 0, 6][:n]
    q = rng.standard_normal((n, heads * hd), dtype=np.float32) / np.sqrt(hd)
    extra = (Tensor(np.array([window], np.int32)),) if window else ()
    got = Attention()(Tensor(q), ms.Parameter(Tensor(kc), name="k"), ms.Parameter(Tensor(vc), name="v"),
                      Tensor(slots), Tensor(token_rows), Tensor(pos), *extra).asnumpy()
    np.testing.assert_allclose(got, reference(q, kc, vc, slots, token_rows, pos, window), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv,hd,q_lens,ctx,window", [
    (9, 3, 64, [1, 40, 1, 3, 9], 48, 21), (4, 2, 16, [33, 1, 1, 8, 2], 48, 5), (4, 4, 128, [1], 48, 21),
    (9, 3, 64, [1], 300, 200), (8, 1, 128, [1], 517, 300)],
    ids=["packed-mix-gqa", "packed-mix-hd16", "one-decode-token-mha-hd128", "one-decode-token-keys-split",
         "one-kv-head-keys-split"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_sliding_window_sees_only_its_last_keys(heads, kv, hd, q_lens, ctx, window, kv_dtype):
    """The optional window input (Mistral, Qwen2's sliding layers): each token attends to the last
    `window` positions of its context, on every path (per token, GEMM chunks, keys split)."""
    test_kernel_matches_numpy(heads, kv, hd, q_lens, ctx, kv_dtype, window)


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 64, 100), (130, 96, 49), (64, 1536, 8)],
                         ids=["one-row", "columns-not-a-multiple-of-16", "many-rows-odd-width", "narrower-than-a-split"])
def test_linear_matches_numpy_also_when_two_run_at_once(m, k, n):
    """Two independent projections in one graph: MindSpore may run them at the same time, and the
    kernels' worker pool must then give each its own correct result."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    setup_mindspore()
    lib = native.library()
    assert lib is not None

    class TwoLinears(nn.Cell):
        def __init__(self, w1, w2):
            super().__init__()
            self.w1 = ms.Parameter(Tensor(w1), name="w1")
            self.w2 = ms.Parameter(Tensor(w2), name="w2")
            self.op = ops.Custom(f"{lib}:LinearBlocks", out_shape=lambda x, w: [x[0], w[0] * w[2]],
                                 out_dtype=lambda x, w: x, func_type="aot")

        def construct(self, x):
            return self.op(x, self.w1), self.op(x, self.w2)

    rng = np.random.default_rng(m * n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w1 = rng.standard_normal((k, n), dtype=np.float32)
    w2 = rng.standard_normal((k, n), dtype=np.float32)
    from agent.model.linear import F32Linear

    (b1,), (b2,) = F32Linear.stored(w1.T), F32Linear.stored(w2.T)  # [out, in] -> 64-column blocks
    y1, y2 = TwoLinears(b1, b2)(Tensor(x))
    x64 = x.astype(np.float64)
    tol = 1e-5 * np.sqrt(k)  # float32 accumulation error over k products of unit-variance terms
    np.testing.assert_allclose(y1.asnumpy()[:, :n], x64 @ w1, atol=tol, rtol=1e-5)
    np.testing.assert_allclose(y2.asnumpy()[:, :n], x64 @ w2, atol=tol, rtol=1e-5)


def test_bench_attention_times_a_step_from_memory_and_in_cache(capsys):
    """tools/bench_attention.py runs the agent's PagedAttention over a written, paged cache."""
    from tools.bench_attention import main

    assert main(["--rows", "3", "--context", "40", "--layers", "2", "--calls", "2", "--kv-dtype", "int8"]) == 0
    lines = {line.split()[0] + " " + line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith(("from memory", "in cache"))}
    assert float(lines["from memory"][2]) > 0 and float(lines["from memory"][6]) > 0
    assert float(lines["in cache"][2]) > 0


def test_large_arrays_start_on_a_huge_page_and_small_ones_on_a_line(monkeypatch):
    """Weights and KV caches come from line_aligned: zeros, writable; from 16 MiB on they start on a
    2 MiB boundary of a mapping advised for transparent huge pages (LLM_SERVING_HUGE_PAGES=0: on a
    line, as smaller arrays)."""
    import mmap

    def memory(a: np.ndarray) -> object:  # what the array's memory belongs to
        while isinstance(a, np.ndarray) and a.base is not None:
            a = a.base
        return a.obj if isinstance(a, memoryview) else a

    big = native.line_aligned((native.HUGE_MIN_BYTES // 2,), np.float16)
    small = native.line_aligned((1000, 3), np.float32)
    for a in (big, small):
        assert a.flags.writeable and not a.any()
        a[...] = 1
    assert big.ctypes.data % native.HUGE_PAGE == 0 and isinstance(memory(big), mmap.mmap)
    assert small.ctypes.data % native.CACHE_LINE == 0 and not isinstance(memory(small), mmap.mmap)
    monkeypatch.setenv("LLM_SERVING_HUGE_PAGES", "0")
    plain = native.line_aligned((native.HUGE_MIN_BYTES,), np.int8)
    assert plain.ctypes.data % native.CACHE_LINE == 0 and not isinstance(memory(plain), mmap.mmap)
