"""Agent model runner vs an independent float64 NumPy forward of the same weights."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from agent.kernels import library
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from server.sampling_params import SamplingParams
from shm.step import RowInput
from tests.agent.drivers import LOGIT_TOL, PROMPTS, PagedDriver, make_runner
from tests.conftest import tiny_model_config
from tests.reference import reference_logits
from tests.helpers import ROOT

DECODE_STEPS = 32


@pytest.fixture(scope="module")
def runner16(tiny_weights):
    return make_runner(tiny_weights, 16)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "mindspore-ops"])
def test_batched_prefill_and_decode_match_reference(runner16, tiny_weights, native):
    runner = runner16 if native else make_runner(tiny_weights, 16, native=False)
    seqs, logits = PagedDriver(runner).run(PROMPTS, DECODE_STEPS)
    cfg = tiny_model_config()
    for prompt, seq, got in zip(PROMPTS, seqs, logits):
        ref = reference_logits(cfg, tiny_weights, seq[:-1])
        want = ref[len(prompt) - 1:]  # logits at the last prompt token, then at every decoded token
        assert np.abs(np.stack(got) - want).max() <= LOGIT_TOL
        assert seq[len(prompt):] == [int(x) for x in want.argmax(-1)]  # greedy tokens identical


def test_batch_one_equals_batch_four(runner16):
    batched, _ = PagedDriver(runner16).run(PROMPTS, 12, collect_logits=False)
    for i, prompt in enumerate(PROMPTS):
        single, _ = PagedDriver(runner16).run([prompt], 12, collect_logits=False)
        assert single[0] == batched[i]


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes_give_identical_tokens(runner16, tiny_weights, block_size):
    want, _ = PagedDriver(runner16).run(PROMPTS, 12, collect_logits=False)
    got, _ = PagedDriver(make_runner(tiny_weights, block_size)).run(PROMPTS, 12, collect_logits=False)
    assert got == want


def test_logprobs_are_real_log_probabilities(runner16, tiny_weights):
    params = SamplingParams(logprobs=5)
    driver = PagedDriver(runner16, params)
    rows = [RowInput(0, np.asarray(PROMPTS[0], np.int32), 0, driver._table(len(PROMPTS[0]), []), True,
                     params, len(PROMPTS[0]), 0)]
    v = driver.arena.step(driver.arena.write_step(rows, 16))
    runner16.step(v, [])
    ref = reference_logits(tiny_model_config(), tiny_weights, PROMPTS[0])[-1]
    ref_lp = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
    assert abs(v.outputs.logprobs[0] - ref_lp[v.outputs.ids[0]]) < LOGIT_TOL
    assert list(v.outputs.top_ids[0, :5]) == list(np.argsort(-ref_lp)[:5])
    assert np.allclose(v.outputs.top_logprobs[0, :5], np.sort(ref_lp)[::-1][:5], atol=LOGIT_TOL)


def test_a_token_in_block_0_is_refused_before_the_model_runs(runner16):
    """Block 0 takes the padding up to a step's bucket, which the stack op skips by its slot: a real
    token there would be skipped too, so the step is refused."""
    driver = PagedDriver(runner16)
    rows = [RowInput(0, np.asarray(PROMPTS[0], np.int32), 0, [0], True, SamplingParams(), len(PROMPTS[0]), 0)]
    with pytest.raises(ValueError, match="block 0 is reserved"):
        runner16.step(driver.arena.step(driver.arena.write_step(rows, 16)), [])


def test_seeded_sampling_is_reproducible(runner16):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a, _ = PagedDriver(runner16, params).run(PROMPTS[:2], 10, collect_logits=False)
    b, _ = PagedDriver(runner16, params).run(PROMPTS[:2], 10, collect_logits=False)
    greedy, _ = PagedDriver(runner16).run(PROMPTS[:2], 10, collect_logits=False)
    assert a == b
    assert a != greedy  # temperature 1 on a random model does sample


def test_repetition_penalty_changes_greedy_output(runner16):
    plain, _ = PagedDriver(runner16).run([PROMPTS[0]], 16, collect_logits=False)
    pen, _ = PagedDriver(runner16, SamplingParams(repetition_penalty=5.0)).run([PROMPTS[0]], 16,
                                                                               collect_logits=False)
    out = pen[0][len(PROMPTS[0]):]
    assert pen != plain
    assert len(set(out)) == len(out)  # so strong a penalty never repeats within 16 tokens


def _mixed_step(runner: ModelRunner, driver: "PagedDriver", order: list[int]) -> dict[int, np.ndarray]:
    """One packed step: 3 decode rows (contexts 7, 40 and 3 tokens already cached) and 2 prefill
    chunks (a 9-token prompt whole, the first 20 of a 30-token prompt), in the given row order.
    Returns each row's logits at its last query token."""
    long_prompt = list(range(100, 130))
    seqs = [PROMPTS[0] + [11], PROMPTS[2] + [12], PROMPTS[1] + [13], [3, 1, 4, 1, 5, 9, 2, 6, 5], long_prompt]
    tables = [driver._table(len(s), []) for s in seqs]
    warm = [RowInput(i, np.asarray(seqs[i][:-1], np.int32), 0, tables[i], False, driver.params,
                     len(seqs[i]) - 1, 0) for i in range(3)]  # the decode rows' contexts, cached first
    v = driver.arena.step(driver.arena.write_step(warm, driver.bs))
    runner.forward(v.inputs)
    rows = {0: (seqs[0][-1:], len(seqs[0]) - 1), 1: (seqs[1][-1:], len(seqs[1]) - 1),
            2: (seqs[2][-1:], len(seqs[2]) - 1), 3: (seqs[3], 0), 4: (seqs[4][:20], 0)}
    step = [RowInput(i, np.asarray(rows[i][0], np.int32), rows[i][1], tables[i], True, driver.params,
                     len(seqs[i]), 0) for i in order]
    v = driver.arena.step(driver.arena.write_step(step, driver.bs))
    logits, _ = runner.forward(v.inputs)
    return {i: logits[k].copy() for k, i in enumerate(order)}, seqs


@pytest.mark.parametrize("order", [[0, 3, 1, 4, 2], [4, 3, 2, 1, 0]], ids=["interleaved", "prefills-first"])
def test_packed_mixed_step_matches_reference(runner16, tiny_weights, order):
    """Decode rows and prefill chunks of different lengths in one graph call, each row equal to the
    float64 reference at its own last query token."""
    got, seqs = _mixed_step(runner16, PagedDriver(runner16), order)
    last = {0: len(seqs[0]) - 1, 1: len(seqs[1]) - 1, 2: len(seqs[2]) - 1, 3: len(seqs[3]) - 1, 4: 19}
    cfg = tiny_model_config()
    for i, pos in last.items():
        ref = reference_logits(cfg, tiny_weights, seqs[i][:pos + 1])[pos]
        assert np.abs(got[i] - ref).max() <= LOGIT_TOL, f"row {i}"


def test_request_alone_and_in_any_mix_gives_identical_tokens(runner16):
    """The same request run alone, with one other, and inside a mixed batch of prompts of other
    lengths and decodes gives the same greedy tokens; no graph is built after warm-up."""
    alone, _ = PagedDriver(runner16).run([PROMPTS[2]], 12, collect_logits=False)
    many = [[i + 1, 2 * i + 3] for i in range(9)] + [PROMPTS[2]]  # 10 rows: all-rows LM head graph
    for mix in ([PROMPTS[0], PROMPTS[2]], [PROMPTS[3], PROMPTS[1], PROMPTS[2], list(range(200, 255))], many):
        got, _ = PagedDriver(runner16).run(mix, 12, collect_logits=False)
        assert got[mix.index(PROMPTS[2])] == alone[0]
    assert runner16.graph_compiles == len(runner16.rc.graph_shapes())


def test_built_graphs_run_without_the_cells_compile_check(runner16, monkeypatch):
    """After warm-up every step goes to the graph executor under the phase recorded for its shape
    (agent.graph_call), not through Cell.__call__ (~1 ms a step of argument-key checks)."""
    want, _ = PagedDriver(runner16).run(PROMPTS, 4, collect_logits=False)

    def refuse(*_):
        raise AssertionError("a built graph went through Cell.__call__")

    monkeypatch.setattr(type(runner16.model), "__call__", refuse)
    got, _ = PagedDriver(runner16).run(PROMPTS, 4, collect_logits=False)
    assert got == want
    assert len(runner16.graph._phases) == len(runner16.rc.graph_shapes())


def test_steps_of_one_row_bucket_share_their_onednn_primitives(runner16, tiny_weights):
    """The decoder stack computes a step's real rows up to their row bucket (agent/kernels/dnnl.h):
    prompts of 113 to 120 tokens all run as 120 rows, so the oneDNN primitives kept per row count
    come in few shapes, and the agent's memory stops growing with every new step length (issue 68).
    Their logits stay the reference's."""
    count = ctypes.CDLL(library()).OnednnPrimitives
    count.restype = ctypes.c_int64
    _, first = PagedDriver(runner16).run([list(range(1, 114))], 0)
    built = count()
    for n in range(114, 121):
        PagedDriver(runner16).run([list(range(1, n + 1))], 0, collect_logits=False)
    # Primitives are kept per thread: a chunk a pool thread runs for the first time may add one (seen
    # once in a loaded suite); a primitive per step length would add dozens here (7 lengths x 4 shapes).
    assert count() - built <= 2
    ref = reference_logits(tiny_model_config(), tiny_weights, list(range(1, 114)))[-1]
    assert np.abs(first[0][0] - ref).max() <= LOGIT_TOL


def test_warmup_runs_every_graph_once(runner16):
    """Warm-up runs each graph once (all padding) after building it: MindSpore allocates a graph's
    buffers at its first run, which would otherwise come under traffic, after ready (issue 68)."""
    assert runner16.model.one_op_stack
    assert runner16.warmed == set(runner16.rc.graph_shapes())


def test_graph_set_is_two_graphs_per_large_token_bucket():
    rc = RunnerConfig(num_blocks=64, block_size=16, max_model_len=1024, token_buckets=[128, 1, 16, 256, 64],
                      max_running=64)
    assert rc.graph_shapes() == [(1, 1, 1),
        (16, 16, 8), (16, 16, 16), (64, 64, 8), (64, 64, 64), (128, 64, 8), (128, 64, 64), (256, 64, 8), (256, 64, 64)]
    assert rc.width == 64


def test_plain_path_chunked_attention_matches_reference(tiny_weights, monkeypatch):
    """The plain-MindSpore path gathers each token's context in chunks of tokens (agent.model.attention
    GATHER_BYTES); with chunks of 24 tokens (a 64-token step ends in a shorter chunk) the
    batched reference test still holds."""
    import agent.model.attention

    monkeypatch.setattr(agent.model.attention, "GATHER_BYTES", 24 * 128 * 2 * 16 * 8)  # 24 tokens of 128 context
    runner = make_runner(tiny_weights, 16, native=False)
    seqs, logits = PagedDriver(runner).run(PROMPTS, 4)
    cfg = tiny_model_config()
    for prompt, seq, got in zip(PROMPTS, seqs, logits):
        want = reference_logits(cfg, tiny_weights, seq[:-1])[len(prompt) - 1:]
        assert np.abs(np.stack(got) - want).max() <= LOGIT_TOL


_PLAIN_4096 = """
import sys
import numpy as np
import agent.model.attention
from agent.packing import GraphInputs
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from agent.graph_call import setup_mindspore
from tests.conftest import tiny_model_config
from tests.reference import random_weights

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) << 10

agent.model.attention.GATHER_BYTES = int(sys.argv[1])
setup_mindspore()
cfg = tiny_model_config()
rc = RunnerConfig(num_blocks=2 + 4096 // 16, block_size=16, max_model_len=4096, token_buckets=[512], max_running=1,
                  native_kernels=False)
runner = ModelRunner(cfg, random_weights(cfg, 0), rc)
runner.warmup()  # builds the graph; its buffers come with the first run
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
base = status("VmRSS")
t = np.arange(3584, 4096, dtype=np.int32)
runner._run(GraphInputs(t % 200, t, t + 16, np.zeros(512, np.int32),
                        np.arange(1, 1 + 4096 // 16, dtype=np.int32)[None], np.array([511], np.int32), None))
print(status("VmHWM") - base)
"""


def test_plain_path_step_memory_is_bounded_at_4096_context():
    """A 512-token chunk at positions 3584-4095 of a 4096-context graph on the plain path, its first
    run (MindSpore allocates a graph's buffers then): gathering every token's whole context at once
    holds 512 x 4096 x kv x head_dim x 8 B = 512 MiB of K/V here (34 GB for llama2-7B); in chunks
    of GATHER_BYTES the step's peak stays near the rest of the graph's ~300 MiB (measured 363 MiB
    chunked, 619 MiB at once, on Zen 4)."""
    import subprocess
    import sys

    import agent.model.attention

    out = subprocess.run([sys.executable, "-c", _PLAIN_4096, str(agent.model.attention.GATHER_BYTES)], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) < 480 << 20, out.stdout
