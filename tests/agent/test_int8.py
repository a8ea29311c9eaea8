"""int8 (W8A8): the kernels (groups: hand-written; per channel: oneDNN's int8 matmul under every ISA
cap this CPU allows) against exact integer NumPy arithmetic and against fp32 within the
quantisation bound, GGUF Q8_0 loaded as stored, SmolLM2's accuracy in int8 vs fp32 (perplexity on
the shipped corpus, greedy continuations), and `launch_agents --dtype int8` serving a server."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from agent import kernels as native
from agent.model.quant import CHANNEL, LANES, Int8Rows, group_for, quantize
from agent.graph_call import setup_mindspore
from tests.agent.kernel_calls import call_kernel, channel_want, integer_tokens
from tests.helpers import channel_refused_here

# The kernels a CPU kind changes: run again as other kinds by tools/test.sh (LLM_SERVING_MAX_ISA).
pytestmark = pytest.mark.isa


def run_kernel(x: np.ndarray, rows: Int8Rows, gain: np.ndarray) -> np.ndarray:
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    setup_mindspore()
    lib = native.library()
    assert lib is not None

    class TwoLinears(nn.Cell):
        """Two at once, as MindSpore may run independent projections: each must get its own result."""

        def __init__(self):
            super().__init__()
            self.q = ms.Parameter(Tensor(native.pack_int8_channel(rows.q) if rows.channel else rows.q), name="q")
            self.s = ms.Parameter(Tensor(rows.scale), name="s")
            self.g = ms.Parameter(Tensor(gain), name="g")
            self.op = ops.Custom(f"{lib}:LinearInt8", out_shape=lambda x, w, sw, *_: [x[0], sw[0]],
                                 out_dtype=lambda x, *_: x, func_type="aot")

        def construct(self, x):
            return self.op(x, self.q, self.s, self.g), self.op(x * 1.0, self.q, self.s, self.g)

    y1, y2 = TwoLinears()(Tensor(x))
    np.testing.assert_array_equal(y1.asnumpy(), y2.asnumpy())
    return y1.asnumpy()


# (tokens, inputs, outputs, group): decode and packed-step row counts including odd tails, widths that
# need padding, several blocks of 8 groups, and 8 groups per row (0).
CASES = [(1, 576, 960, 64), (3, 100, 33, 32), (5, 1536, 577, 0), (7, 96, 49, 4), (130, 64, 40, 32), (2, 40, 8, 0)]


@pytest.mark.parametrize("k,group,blocks", [(576, 72, 1), (1536, 64, 3), (5632, 64, 11), (8192, 64, 16),
                                            (11008, 60, 23), (14336, 72, 25), (48, 8, 1)])
def test_groups_of_at_most_72_take_the_fewest_blocks_that_pad_under_1_percent(k, group, blocks):
    """The default target (72): fewer blocks (one scaling pass each) only where they add no padding
    worth more than 1% of a row (8192 inputs as 15 blocks of 72 would pad 5.5%); rows too short for
    that keep the least padding."""
    assert group_for(k, 72) == group
    assert -(-k // (LANES * group)) == blocks


@pytest.mark.parametrize("m,k,n,group", CASES)
def test_kernel_sums_exactly_in_integers(m, k, n, group):
    """Integer activations whose every (token, group) reaches 127 quantise to themselves (scale 1):
    the kernel's result is then Σ_groups weight scale x exact integer dot product."""
    rng = np.random.default_rng(m * k + n)
    rows = quantize(rng.standard_normal((n, k)).astype(np.float32), group)
    g = rows.group
    x = rng.integers(-127, 128, (m, k)).astype(np.float32)
    x[:, ::g] = 127 * rng.choice([-1, 1], (m, len(range(0, k, g))))  # each group's max is exactly 127
    got = run_kernel(x, rows, np.ones(k, np.float32))
    xi = np.zeros((m, rows.q.shape[1]), np.int64)
    xi[:, :k] = x
    dots = np.einsum("mgk,ngk->mng", xi.reshape(m, -1, g), rows.natural().astype(np.int64).reshape(n, -1, g))
    want = (dots * rows.scale[None].astype(np.float64)).sum(-1)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("group", [0, 64, 8, CHANNEL])
def test_kernel_stays_within_the_quantisation_bound_of_fp32(group):
    """Against fp32 x @ w^T with a gain and outlier channels: |error| is at most what rounding each
    activation (half its group's step) and each weight (its actual rounding) can cause."""
    if group == CHANNEL and channel_refused_here():
        return
    rng = np.random.default_rng(abs(group))
    m, k, n = 9, 1152, 70
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, [5, 77, 700]] *= 40  # outlier channels, as in real activations
    gain = rng.uniform(0.2, 2.0, k).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    rows = quantize(w, group)
    got = run_kernel(x, rows, gain)
    xg = (x * gain).astype(np.float64)
    gs = k if rows.channel else rows.group
    step = np.repeat(np.abs(xg).reshape(m, -1, gs).max(-1) / 127, gs, axis=1)  # activation step per element
    dw = rows.dequantize().astype(np.float64) - w
    bound = (step / 2) @ np.abs(w).T + np.abs(xg) @ np.abs(dw).T + (step / 2) @ np.abs(dw).T
    err = np.abs(got - xg @ w.T)
    assert np.all(err <= bound * 1.001 + 1e-3), float((err - bound).max())
    assert err.max() > 0  # it did quantise


@pytest.mark.parametrize("group", [64, CHANNEL])
def test_a_row_gives_the_same_bits_alone_and_among_other_rows(group):
    """A row's result must not depend on the rows computed with it (tiles of 3, 2 and 1 tokens, and
    one channel at a time up to 4 tokens; oneDNN's kernels for each row count): batch 1 and batch N
    then give identical tokens."""
    if group == CHANNEL and channel_refused_here():
        return
    rng = np.random.default_rng(5)
    k, n = 576, 48
    rows = quantize(rng.standard_normal((n, k)).astype(np.float32), group)
    x = rng.standard_normal((10, k)).astype(np.float32)  # tiles of 3, 3, 2, 2 tokens
    gain = np.ones(k, np.float32)
    many = run_kernel(x, rows, gain)
    for i in (0, 9):
        np.testing.assert_array_equal(run_kernel(x[i:i + 1], rows, gain)[0], many[i])


@pytest.mark.parametrize("group", [64, CHANNEL])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_lora_a_rows_beside_int8_weights_stay_float(group, m):
    """LoRA on an int8 base: A [E, K] after the op's weights adds E output columns, each the float
    input (before its gain and quantisation) times A in float32, and leaves the int8 columns'
    bits as they were without it; the fused residual add + RMSNorm feeds A its normed row."""
    import ctypes

    if group == CHANNEL and channel_refused_here():
        return
    lib = ctypes.CDLL(native.library())
    rng = np.random.default_rng(m)
    k, n, e = 576, 70, 48
    rows = quantize(rng.standard_normal((n, k)).astype(np.float32), group)
    q = native.pack_int8_channel(rows.q) if rows.channel else rows.q
    gain = rng.uniform(0.5, 2.0, k).astype(np.float32)
    a = rng.standard_normal((e, k)).astype(np.float32)
    x, d = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, k)).astype(np.float32)
    plain, wide = np.zeros((m, n), np.float32), np.zeros((m, n + e), np.float32)
    assert call_kernel(lib, "LinearInt8", [x, q, rows.scale, gain, plain]) == 0
    assert call_kernel(lib, "LinearInt8", [x, q, rows.scale, gain, a, wide]) == 0
    np.testing.assert_array_equal(wide[:, :n], plain)
    every = wide.copy()
    np.testing.assert_allclose(wide[:, n:], x.astype(np.float64) @ a.T, rtol=1e-4, atol=1e-4)
    eps, total = np.array([1e-6], np.float32), np.zeros((m, k), np.float32)
    assert call_kernel(lib, "AddRmsLinearInt8", [x, d, eps, q, rows.scale, gain, a, total, wide]) == 0
    s = (x + d).astype(np.float64)
    normed = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(wide[:, n:], normed @ a.T, rtol=1e-4, atol=1e-4)
    # with each token's slot (3 slots of 16 rows; every 4th token none): its own slot's columns alone
    slot = np.arange(m) % 4 - 1
    mask = np.zeros((m, 3), np.float32)
    mask[slot >= 0, slot[slot >= 0]] = 1.0
    want = np.zeros((m, e))
    for t in np.flatnonzero(slot >= 0):
        cols = slice(16 * slot[t], 16 * slot[t] + 16)
        want[t, cols] = x[t].astype(np.float64) @ a[cols].T
    wide[:] = np.nan
    assert call_kernel(lib, "LinearInt8", [x, q, rows.scale, gain, a, mask, wide]) == 0
    np.testing.assert_array_equal(wide[:, :n], plain)
    np.testing.assert_allclose(wide[:, n:], want, rtol=1e-4, atol=1e-4)
    # a token's columns are its bits alone, whatever else the step holds (identical rows of one
    # adapter gathered into one sgemm came back apart)
    for t in range(m):
        alone = np.full((1, n + e), np.nan, np.float32)
        assert call_kernel(lib, "LinearInt8", [x[t:t + 1], q, rows.scale, gain, a, mask[t:t + 1], alone]) == 0
        np.testing.assert_array_equal(alone[0], wide[t])
        assert call_kernel(lib, "LinearInt8", [x[t:t + 1], q, rows.scale, gain, a, alone]) == 0
        np.testing.assert_array_equal(alone[0], every[t])


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 100, 33), (5, 1536, 577), (10, 576, 48), (130, 64, 40), (64, 576, 1536)])
def test_channel_kernel_sums_exactly_in_integers(m, k, n):
    if channel_refused_here():
        return
    rng = np.random.default_rng(m * k + n)
    rows = quantize(rng.standard_normal((n, k)).astype(np.float32), CHANNEL)
    assert rows.channel and rows.q.shape == (n, k) and rows.scale.shape == (n, 1)
    x = integer_tokens(rng, m, k)
    want = channel_want(x, rows)
    np.testing.assert_allclose(run_kernel(x, rows, np.ones(k, np.float32)), want, rtol=2e-6,
                               atol=1e-6 * np.abs(want).max())


_ISA_CHILD = """
import ctypes, sys
import numpy as np
from agent import kernels
from agent.model.quant import CHANNEL, quantize
from tests.agent.kernel_calls import call_kernel, channel_want, integer_tokens
lib = ctypes.CDLL(kernels.library())
lib.Int8ChannelKernelPath.restype = ctypes.c_char_p
print(lib.Int8ChannelKernelPath().decode())
try:
    kernels.pack_int8_channel(np.ones((64, 64), np.int8))
except RuntimeError as e:
    print("refused:", e)
    sys.exit(0)
for m, k, n in [(1, 576, 960), (4, 1536, 577), (64, 576, 1536), (130, 64, 40)]:
    rng = np.random.default_rng(m + k + n)
    rows = quantize(rng.standard_normal((n, k)).astype(np.float32), CHANNEL)
    x, y = integer_tokens(rng, m, k), np.zeros((m, n), np.float32)
    assert call_kernel(lib, "LinearInt8", [x, kernels.pack_int8_channel(rows.q), rows.scale, np.ones(k, np.float32), y]) == 0
    want = channel_want(x, rows)
    print(m, k, n, float(np.abs(y - want).max() / np.abs(want).max()))
"""

# oneDNN's ISA caps: every int8 matmul implementation it has for the CPU kinds we serve on, run where
# this CPU allows it (an AMX Xeon runs all three; a Zen 4 the last two; an AVX2-only CPU the last).
# Below VNNI oneDNN's int8 gemm (gemm:jit, vpmaddubsw) saturates its int16 pair sums: refused by name.
ISA_CAPS = [("AVX10_1_512_AMX", {"amx_int8"}, "brg_matmul:avx10_1_512_amx"),
            ("AVX512_CORE_VNNI", {"avx512_vnni"}, "brg_matmul:avx512_core_vnni"), ("AVX2", {"avx2"}, None)]


@pytest.mark.parametrize("cap, needs, impl", ISA_CAPS, ids=[c[0] for c in ISA_CAPS])
def test_channel_path_is_exact_on_every_isa_this_cpu_has(cap, needs, impl):
    import os
    import subprocess
    import sys

    from common.cpu import cpu_flags
    from tests.helpers import ROOT

    if needs - cpu_flags():
        pytest.skip(f"oneDNN's {cap} int8 matmul cannot run on this CPU (no {' '.join(sorted(needs))})")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}  # read when oneDNN first dispatches
    out = subprocess.run([sys.executable, "-c", _ISA_CHILD], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    path, *cases = out.stdout.strip().splitlines()
    if impl is None:
        assert "unavailable" in path and "saturate" in path and cases[0].startswith("refused:"), out.stdout
        return
    assert f"[{impl}" in path, path  # oneDNN's own kernel for that ISA, not its reference
    if cap == "AVX512_CORE_VNNI":  # its layout is the one our few-token stream reads: the stream ran
        assert "stream" in path, path
    assert len(cases) == 4 and all(float(c.split()[-1]) < 2e-6 for c in cases), out.stdout


def test_q8_0_gguf_loads_as_stored(tmp_path):
    """Q8_0 tensors reach the model as their own int8 values and block scales (groups of 32), equal to
    the float loader's dequantisation; without int8 they load as float32."""
    from agent.model_config import ModelConfig
    from agent.weights.load import load_model
    from common.model_files import ModelFiles, resolve_model
    from tools.export_model import random_llama, write_gguf

    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True, max_position=256, eos_token_ids=[2])
    w = random_llama(cfg, seed=2)
    path = tmp_path / "m-q8_0.gguf"
    write_gguf(path, cfg, w, resolve_model("smollm2").path, "q8_0")
    _, as_float = load_model(ModelFiles("gguf", path))
    _, as_int8 = load_model(ModelFiles("gguf", path), int8=True)
    for name, arr in w.items():
        if arr.ndim == 2:
            rows = as_int8[name]
            assert isinstance(rows, Int8Rows) and rows.group == 32 and rows.q.dtype == np.int8
            np.testing.assert_array_equal(rows.dequantize(), as_float[name])
            assert np.abs(as_float[name] - arr).max() <= np.abs(arr).max() / 127  # Q8_0's own rounding
        else:
            np.testing.assert_array_equal(as_int8[name], arr)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_half_and_int8_without_native_kernels_are_refused_clearly(dtype):
    from agent.model.backend import Backend

    with pytest.raises(ValueError, match=f"model_dtype {dtype} needs the native kernels"):
        Backend(dtype, None)


def test_launch_agents_dtype_int8_serves_an_attached_server(tmp_path, tiny_model_dir):
    """`launch_agents --dtype int8` (the YAML says nothing of dtype) and `llm-serving --attach`: both
    info endpoints say int8 (the agents' dtype, not the server's YAML), and a greedy request returns
    what our int8 runner computes in this process from the same weights and calibration."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from agent.model.calibrate import CALIBRATION_TEXT
    from common.config import int8_group
    from common.cpu import cpu_flags
    from agent.graph_call import setup_mindspore
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.weights.load import load_model
    from common.model_files import ModelFiles
    from common.tokenizer import load_tokenizer
    from tests.helpers import ROOT, ServerProcess, tiny_config
    from tools.eval_quant import greedy

    config = tiny_config(tmp_path, tiny_model_dir)
    (tmp_path / "run").mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLM_SERVING_RUNTIME_DIR": str(tmp_path / "run")}
    log = tmp_path / "launch.log"
    launcher = subprocess.Popen([sys.executable, "-m", "llm_serving.launch", "--config", str(config), "--dtype", "int8"],
                                cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "all agents started" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        srv = ServerProcess(config, "--attach", env=env)
        try:
            assert httpx.get(f"{srv.url}/info").json()["model_dtype"] == "int8"
            assert '"model_dtype": "int8"' in httpx.get(f"{srv.url}/serving/get_serverd_model_info").text
            prompt = [5, 60, 61, 62, 9, 33, 120]
            r = httpx.post(f"{srv.url}/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 6, "ignore_eos": True, "details": True}}, timeout=120).json()
            served = [t["id"] for t in r["details"]["tokens"]]
        finally:
            srv.stop()
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(60)
    files = ModelFiles("hf", tiny_model_dir)
    cfg, weights = load_model(files, 128, int8=True)
    setup_mindspore()  # graph mode, as the agents run (alone, no earlier test of this process set it)
    rc = RunnerConfig(num_blocks=16, block_size=16, max_model_len=128, token_buckets=[1, 16], max_running=1,
                      model_dtype="int8", int8_group=int8_group("auto", cpu_flags()))  # as the agents chose
    runner = ModelRunner(cfg, weights, rc, calibration=load_tokenizer(files).encode(CALIBRATION_TEXT))
    assert served == greedy(runner, [prompt], 6)[0]


# Every int8 code path, each built for its instruction set and run here when this CPU has it: the
# path the agent's -march=native build takes is only one of them.
# AVX512-VNNI runs twice: its 256- and 512-bit tiles (the library times both and keeps the faster;
# LLM_SERVING_INT8_VECTOR picks one).
AVX512 = {"avx512_vnni", "avx512bw", "avx512vl"}
PATHS = [("haswell", {"avx2", "fma"}, "AVX2 vpmaddubsw", ""), ("alderlake", {"avx_vnni"}, "AVX-VNNI", ""),
         ("icelake-server", AVX512, "AVX512-VNNI vpdpbusd (256-bit)", "256"),
         ("icelake-server", AVX512, "in 512-bit tiles", "512")]


@pytest.mark.parametrize("march, needs, name, vector", PATHS, ids=[p[2] for p in PATHS])
def test_every_int8_path_this_cpu_has_sums_exactly(march, needs, name, vector, tmp_path, monkeypatch):
    import ctypes
    import subprocess

    from agent.kernels import FLAGS, KERNEL_DIR, _dnnl_flags
    from common.cpu import cpu_flags

    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"the {name} int8 path cannot run on this CPU (no {' '.join(sorted(missing))})")
    monkeypatch.setenv("LLM_SERVING_INT8_VECTOR", vector)  # read on the library's first int8 call
    lib_path = tmp_path / f"int8-{march}.so"
    flags = [f for f in FLAGS if not f.startswith("-march")]
    subprocess.run(["g++", *flags, f"-march={march}", "-o", str(lib_path), str(KERNEL_DIR / "linear_int8.cpp"),
                    str(KERNEL_DIR / "int8_channel.cpp"), str(KERNEL_DIR / "int8_stream.cpp"), *_dnnl_flags()],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.Int8KernelPath.restype = ctypes.c_char_p
    assert name in lib.Int8KernelPath().decode()
    for m, k, n, group in CASES + [(64, 576, 96, 64), (9, 1536, 40, 64)]:  # decode, packed and 4+ token steps
        rng = np.random.default_rng(m * k + n)
        rows = quantize(rng.standard_normal((n, k)).astype(np.float32), group)
        g = rows.group
        x = rng.integers(-127, 128, (m, k)).astype(np.float32)
        x[:, ::g] = 127 * rng.choice([-1, 1], (m, len(range(0, k, g))))
        y = np.zeros((m, n), np.float32)
        assert call_kernel(lib, "LinearInt8", [x, rows.q, rows.scale, np.ones(k, np.float32), y]) == 0
        xi = np.zeros((m, rows.q.shape[1]), np.int64)
        xi[:, :k] = x
        dots = np.einsum("mgk,ngk->mng", xi.reshape(m, -1, g), rows.natural().astype(np.int64).reshape(n, -1, g))
        want = (dots * rows.scale[None].astype(np.float64)).sum(-1)
        np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-6 * np.abs(want).max(), err_msg=f"{m},{k},{n},{group}")


def test_bench_int8_kernel_times_every_shape_and_token_count(capsys):
    """tools/bench_int8_kernel.py runs on the agent's kernel library: a row per shape and token count,
    the per-channel columns "-" where this CPU refuses that path."""
    import os

    from tools.bench_int8_kernel import main

    cores = os.sched_getaffinity(0)
    try:
        assert main(["--shapes", "64x32,96x40", "--tokens", "1,5", "--calls", "3"]) == 0
    finally:
        os.sched_setaffinity(0, cores)  # the tool pins this process to its first core
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["64x32"], ["96x40"])]
    assert [(r[0], r[1]) for r in rows] == [("64x32", "1"), ("64x32", "5"), ("96x40", "1"), ("96x40", "5")]
    assert all(float(r[4].rstrip("x")) > 0 and float(r[5].rstrip("x")) > 0 for r in rows)  # bf16, int8 groups
    refused = channel_refused_here()
    assert all((r[6] == "-") if refused else float(r[6].rstrip("x")) > 0 for r in rows)  # int8 per channel
