"""serving_config.deterministic: a request's tokens and logprobs do not depend on what else runs.
Eight prompts, each alone and prefilled whole, against the same prompts among 56 other sequences in
64-row steps, prefilled in chunks: the tokens, their logprobs and the top-5 alternatives are equal
bit for bit, in float32, bfloat16 and int8, greedy and seeded, and after a preemption
(tools/bench_invariance.py's comparison, on a small random model whose heads are 64 wide: the
attention kernel's vector path, whose one-sequence decode would split its keys over the cores, and
one context past the split's threshold of 2 cores x 64 keys); in float32 on each family's fixture
(sliding windows, q/k norms, Gemma 3's layers); and on LoRA adapters, float32 and int8."""
from __future__ import annotations

import numpy as np
import pytest

from agent.graph_call import setup_mindspore
from agent.model_config import ModelConfig
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from agent.weights.load import load_model
from common.model_files import ModelFiles
from server.sampling_params import SamplingParams
from agent.lora import read_adapter
from agent.model.lora import LoraSlots
from tests.agent.goldens import ADAPTERS, FIXTURES, LORA
from tests.reference import random_weights
from tools.bench_invariance import BS, BUCKETS, ROWS, compare

MAX_LEN = 256
FAMILIES = ["gemma3-pattern-tf5", "llama3-tf5", "ministral-tf5", "mistral-window-tf5", "qwen2-window-tf5", "qwen3-tf5"]


def _runner(cfg: ModelConfig, weights: dict, dtype: str = "float32", lora: LoraSlots | None = None) -> ModelRunner:
    setup_mindspore()
    rc = RunnerConfig(num_blocks=1 + ROWS * (MAX_LEN // BS), block_size=BS, max_model_len=MAX_LEN, token_buckets=BUCKETS,
                      max_running=ROWS, model_dtype=dtype, deterministic=True,
                      lora=(lora.slots, lora.rank) if lora else (0, 0))
    runner = ModelRunner(cfg, weights, rc, calibration=list(range(1, 200)) if dtype == "int8" else None, lora=lora)
    runner.warmup(freeze=False)
    return runner


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8"])
def runner(request) -> ModelRunner:
    cfg = ModelConfig(vocab_size=272, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                      rms_eps=1e-5, rope_theta=10000.0, max_position=MAX_LEN, bos_token_id=256, eos_token_ids=[257])
    return _runner(cfg, random_weights(cfg, seed=3), request.param)


@pytest.mark.isa  # the kernels' paths follow the CPU kind (tools/test.sh runs these capped too)
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("params", [SamplingParams(logprobs=5), SamplingParams(logprobs=5, temperature=0.8, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_a_request_gives_the_same_bits_alone_and_among_56_others(runner, params, chunk):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 250, int(n)).tolist() for n in rng.integers(20, 200, 7)]
    prompts.append(rng.integers(1, 250, 190).tolist())  # decoding alone past the attention's split threshold
    assert compare(runner, prompts, chunk, params) == (8, 8)


@pytest.mark.isa
def test_a_preempted_request_computed_again_gives_the_same_bits(runner):
    """Each of the eight preempted after its third token, among the others: its prompt and output so
    far computed again in chunks, and it goes on with the bits it had alone."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 250, int(n)).tolist() for n in rng.integers(20, 120, 8)]
    assert compare(runner, prompts, 16, SamplingParams(logprobs=5), preempt_at=3) == (8, 8)


@pytest.mark.parametrize("folder", FAMILIES)
def test_every_family_gives_the_same_bits_alone_and_among_others(folder):
    cfg, weights = load_model(ModelFiles("hf", FIXTURES / folder), max_position=MAX_LEN)
    runner = _runner(cfg, weights)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 250, int(n)).tolist() for n in rng.integers(20, 120, 8)]
    assert compare(runner, prompts, 16, SamplingParams(logprobs=5)) == (8, 8)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_requests_on_lora_adapters_give_the_same_bits_alone_and_among_others(dtype):
    """Two adapters in slots (PEFT's fixtures on the tiny Llama) and the base: each prompt on its own
    adapter, the others on random ones, every row of a step on its slot."""
    base = FIXTURES / "llama-tf5"
    cfg, weights = load_model(ModelFiles("hf", base), max_position=MAX_LEN, int8=dtype == "int8")
    lora = LoraSlots([read_adapter(name, LORA / "llama-tf5" / name, cfg, 16) for name in ADAPTERS], 2, 16)
    runner = _runner(cfg, weights, dtype, lora)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 250, int(n)).tolist() for n in rng.integers(20, 120, 8)]
    assert compare(runner, prompts, 16, SamplingParams(logprobs=5), adapters=[i % 3 for i in range(8)]) == (8, 8)


def test_without_the_native_kernels_it_is_refused():
    """The plain MindSpore path cannot keep the promise: refused at load, not served variant."""
    cfg = ModelConfig(vocab_size=272, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                      rms_eps=1e-5, rope_theta=10000.0, max_position=MAX_LEN, bos_token_id=256, eos_token_ids=[257])
    rc = RunnerConfig(num_blocks=64, block_size=BS, max_model_len=MAX_LEN, token_buckets=[64], max_running=4,
                      native_kernels=False, deterministic=True)
    with pytest.raises(ValueError, match="deterministic needs the native kernels"):
        ModelRunner(cfg, random_weights(cfg, seed=3), rc)
