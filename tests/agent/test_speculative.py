"""Speculative decoding on the agent (agent/speculative/): n-gram and draft-model drafts verified in the
packed step give token for token what plain decoding gives, greedy and seeded, alone and batched,
with penalties and logprobs; the proposers themselves on known sequences."""
from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager

import numpy as np
import pytest

from agent.speculative.draft_model import DraftModelProposer
from agent.speculative.ngram import NgramProposer
from server.sampling_params import SamplingParams
from tests.agent.drivers import SpecDriver, make_runner

LOOPY = [[5, 6, 7, 8, 9] * 6, [40, 41, 42, 40, 41, 42, 40, 41], [100, 3, 100, 3, 100], list(range(60, 75)) * 2]


def test_ngram_proposes_what_followed_the_longest_suffix_seen_before():
    p = NgramProposer(1, 3)
    seq = np.array([1, 2, 3, 4, 5, 9, 2, 3], np.int32)
    assert p.propose(seq, 3).tolist() == [4, 5, 9]  # "2 3" seen at 1..2, followed by 4 5 9
    assert p.propose(np.array([1, 2, 3, 7], np.int32), 2).tolist() == []  # 7 never seen before
    assert p.propose(np.array([8, 1, 8, 2, 8], np.int32), 2).tolist() == [2, 8]  # the latest "8" with 2 after it
    assert NgramProposer(2, 3).propose(np.array([1, 2, 9, 2], np.int32), 2).tolist() == []  # 1-grams too short


def _proposing_runner(weights, block_size=16):
    runner = make_runner(weights, block_size)
    runner.use_proposer(NgramProposer(1, 3))
    return runner


@pytest.fixture(scope="module")
def spec_runner(tiny_weights):
    return _proposing_runner(tiny_weights)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.1, top_p=0.9, seed=7),
                                    SamplingParams(repetition_penalty=1.02, frequency_penalty=0.01, logprobs=3)],
                         ids=["greedy", "seeded-top-p", "penalty-logprobs"])
def test_drafts_change_no_token(spec_runner, params):
    want = [SpecDriver(spec_runner, params, 0).run([p], 24, seq0=100 + i)[0] for i, p in enumerate(LOOPY)]
    driver = SpecDriver(spec_runner, params, 4)
    got = [driver.run([p], 24, seq0=200 + i)[0] for i, p in enumerate(LOOPY)]
    assert got == want
    batched = SpecDriver(spec_runner, params, 3)  # 4 rows of 1 + 3: the 16 LM-head rows of this runner
    assert batched.run(LOOPY, 24, seq0=300) == want
    assert driver.accepted > 0 and batched.accepted > 0  # drafts were accepted, not only proposed
    assert driver.short > 0  # and rows whose empty draft slots the agent dropped gave the same tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_drafts_change_no_token_in_every_dtype_with_deterministic_kernels(tiny_weights, dtype):
    """A verify row of 1 + k tokens is a batch of its own: with batch-invariant kernels its logits are
    plain decoding's in every dtype, so n-gram and int8 self-drafts change no token (float32 above,
    without them)."""
    runner = make_runner(tiny_weights, 16, dtype=dtype, deterministic=True)
    params = SamplingParams(logprobs=3)
    want = [SpecDriver(runner, params, 0).run([p], 24, seq0=100 + i)[0] for i, p in enumerate(LOOPY)]
    int8 = make_runner(tiny_weights, 16, num_blocks=runner.rc.num_blocks, dtype="int8", deterministic=True)
    for seq0, proposer in ((300, NgramProposer(1, 3)), (400, DraftModelProposer(int8, "self_int8"))):
        runner.use_proposer(proposer)
        driver = SpecDriver(runner, params, 3)
        assert driver.run(LOOPY, 24, seq0=seq0) == want and driver.accepted > 0, proposer.method


# ------------------------------------------------------------------ draft models (self_int8, draft)
@contextmanager
def drafting(runner, proposer):
    """`runner` with `proposer` for the block (its own proposer again after)."""
    old = runner.seqs.proposer
    runner.use_proposer(proposer)
    try:
        yield runner
    finally:
        runner.use_proposer(old)


def _draft(weights, target, dtype: str) -> DraftModelProposer:
    """A draft of the same weights in `dtype` with the target's KV geometry (as agent.speculative.draft_load
    builds it)."""
    return DraftModelProposer(make_runner(weights, 16, num_blocks=target.rc.num_blocks, dtype=dtype), "draft")


@pytest.fixture(scope="module")
def int8_draft(tiny_weights, spec_runner):
    return _draft(tiny_weights, spec_runner, "int8")


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=11),
                                    SamplingParams(repetition_penalty=1.05, logprobs=2)],
                         ids=["greedy", "seeded-top-k", "penalty-logprobs"])
def test_self_int8_drafts_change_no_token(spec_runner, int8_draft, params):
    """The int8 self-draft's proposals, verified, give what the float32 target gives plainly: one
    sequence at a time, and 4 in each step (their draft KV kept between steps and caught up)."""
    plain = SpecDriver(spec_runner, params, 0)
    want = [plain.run([p], 20, seq0=400 + i)[0] for i, p in enumerate(LOOPY)]
    with drafting(spec_runner, int8_draft) as runner:
        driver = SpecDriver(runner, params, 4)
        assert [driver.run([p], 20, seq0=500 + i)[0] for i, p in enumerate(LOOPY)] == want
        batched = SpecDriver(runner, params, 3)
        assert batched.run(LOOPY, 20, seq0=600) == want
    assert driver.accepted > 0 and batched.accepted > 0
    assert driver.short == 0  # a draft model fills every slot


def test_a_draft_of_the_target_itself_is_always_accepted_greedy(tiny_weights, spec_runner):
    """A float32 draft of the target's own weights proposes the target's argmax: every greedy draft
    is kept, which fails if the draft's KV (caught up lazily, fed drafts kept) were out of step."""
    want = SpecDriver(spec_runner, SamplingParams(), 0).run(LOOPY, 24, seq0=700)
    with drafting(spec_runner, _draft(tiny_weights, spec_runner, "float32")) as runner:
        driver = SpecDriver(runner, SamplingParams(), 3)  # 4 rows of 1 + 3: the 16 LM-head rows of this runner
        assert driver.run(LOOPY, 24, seq0=800) == want
    steps = 1 + -(-23 // 4)  # the prefill, then 1 + 3 tokens a decode
    assert driver.accepted == len(LOOPY) * (24 - steps)


def test_a_prompt_longer_than_a_steps_catch_up_drafts_once_it_has_caught_up(spec_runner, int8_draft):
    """With 8 catch-up tokens a step, a 30-token prompt's first 4 decodes take no drafts (its draft KV
    fills 8 tokens a step while the sequence grows by one), then it drafts; the tokens equal plain
    decoding's."""
    want = SpecDriver(spec_runner, SamplingParams(), 0).run([LOOPY[0]], 16, seq0=950)
    budget, int8_draft.budget = int8_draft.budget, 8
    try:
        with drafting(spec_runner, int8_draft) as runner:
            driver = SpecDriver(runner, SamplingParams(), 3)
            assert driver.run([LOOPY[0]], 16, seq0=960) == want
    finally:
        int8_draft.budget = budget
    assert driver.short == 4 and driver.accepted > 0


def test_a_restarted_history_is_drafted_from_scratch(spec_runner, int8_draft):
    """A sequence re-admitted from position 0 (preemption) forgets its draft KV: the proposer's state
    is gone, and the run still equals the first."""
    with drafting(spec_runner, int8_draft) as runner:
        first = SpecDriver(runner, SamplingParams(), 3).run([LOOPY[0]], 12, seq0=900)
        assert int8_draft.cached[900].n > len(LOOPY[0])
        SpecDriver(runner, SamplingParams(), 3).run([LOOPY[0] + first[-1][len(LOOPY[0]):]], 1, seq0=900)
        assert 900 not in int8_draft.cached  # the re-admitted prompt (prompt + output) forgot it
        again = SpecDriver(runner, SamplingParams(), 3).run([LOOPY[0]], 12, seq0=900)
    assert again == first


# ------------------------------------------------------------------ the verification's distribution
V, DEPTH, TRIALS = 4, 3, 4000


def _toy_logits(context: list[int]) -> np.ndarray:
    """A tiny-vocabulary "model": fixed logits for every context."""
    key = sum((t + 1) * 5 ** i for i, t in enumerate(context))
    return (np.random.default_rng(key).normal(size=V) * 1.2).astype(np.float32)


def _columns(n: int, temperature: float, top_p: float):
    from shm.step import SamplingColumns
    return SamplingColumns(**{f: np.full(n, v, dt) for f, v, dt in (
        ("prompt_len", 1, np.int32), ("output_len", 0, np.int32), ("temperature", temperature, np.float32),
        ("top_k", 0, np.int32), ("top_p", top_p, np.float32), ("min_p", 0.0, np.float32),
        ("repetition_penalty", 1.0, np.float32), ("presence_penalty", 0.0, np.float32),
        ("frequency_penalty", 0.0, np.float32), ("seed", -1, np.int64), ("n_logprobs", 0, np.int32),
        ("n_prompt_logprobs", 0, np.int32))})


def _draw(context: list[int], rng, temperature: float, top_p: float) -> int:
    from agent.sampling import sample
    lg = _toy_logits(context)[None, :].copy()
    lse = np.log(np.exp(lg - lg.max()).sum(axis=1)) + lg.max()
    return int(sample(lg, lse, _columns(1, temperature, top_p), [None], rng).ids[0])


def _speculated(prompt: list[int], drafts: list[int], rng, temperature: float, top_p: float) -> tuple[int, ...]:
    """The first DEPTH tokens: one verification of `drafts`, then plain sampling for the rest."""
    from agent.sampling import sample
    from agent.speculative.verify import verify
    logits = np.stack([_toy_logits(prompt + drafts[:j]) for j in range(len(drafts) + 1)])
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)

    def sample_pass(lg, ls, at, j):
        return sample(lg.copy(), ls, _columns(len(at), temperature, top_p), [None] * len(at), rng)

    head = np.arange(len(drafts) + 1)[None, :]
    final, accepted, kept = verify(sample_pass, lambda *_: None, logits, lse, np.array([0]), head,
                                   np.array([drafts]), np.array([len(drafts)]), 0)
    out = kept.ids[0, :accepted[0]].tolist() + [int(final.ids[0])]
    while len(out) < DEPTH:
        out.append(_draw(prompt + out, rng, temperature, top_p))
    return tuple(out[:DEPTH])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.95)])
def test_verified_drafts_keep_the_sampling_distribution(temperature, top_p):
    """Chi-square, two samples of TRIALS: the first DEPTH tokens sampled plainly, and through one
    verification of drafts that are often right (the plain chain's likeliest tokens) and sometimes
    not; the two distributions over the V**DEPTH outcomes agree (p > 0.001, fixed seeds)."""
    prompt, rng = [1, 2], np.random.default_rng(5)
    plain: dict[tuple[int, ...], int] = {}
    for _ in range(TRIALS):
        out: list[int] = []
        for _ in range(DEPTH):
            out.append(_draw(prompt + out, rng, temperature, top_p))
        plain[tuple(out)] = plain.get(tuple(out), 0) + 1
    likely = []
    for _ in range(DEPTH):
        likely.append(int(np.argmax(_toy_logits(prompt + likely))))
    spec: dict[tuple[int, ...], int] = {}
    for t in range(TRIALS):
        drafts = likely if t % 4 else [(x + 1) % V for x in likely]
        key = _speculated(prompt, drafts, rng, temperature, top_p)
        spec[key] = spec.get(key, 0) + 1
    cells = [c for c in set(plain) | set(spec) if plain.get(c, 0) + spec.get(c, 0) >= 10]
    stat = sum((plain.get(c, 0) - spec.get(c, 0)) ** 2 / (plain.get(c, 0) + spec.get(c, 0)) for c in cells)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
    assert df >= 8 and stat < critical, (stat, critical, df)


def test_a_draft_with_another_tokenizer_is_refused_by_name(tmp_path, tiny_model_dir):
    """`draft` with a model whose vocabulary is another (two tokens swapped; SmolLM2's 49152) is a
    ConfigError naming the difference, before any graph is built."""
    from agent.runner_config import RunnerConfig
    from agent.speculative.draft_load import load_draft
    from common.config import ConfigError, load_config
    from common.model_files import resolve_model
    from common.tokenizer import load_tokenizer
    from tests.conftest import TINY
    from tests.helpers import tiny_config

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    doc = json.loads((other / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (65, 66))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(doc))
    target = load_tokenizer(resolve_model(str(tiny_model_dir), None))
    rc = RunnerConfig(num_blocks=40, block_size=4, max_model_len=128, token_buckets=[1], max_running=1)
    for path, says in ((other, "token 65 is"), ("smollm2", "its vocabulary has 49152 rows")):
        cfg = load_config(tiny_config(tmp_path, tiny_model_dir), spec_method="draft", spec_draft_model=str(path))
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_draft(cfg, rc, TINY["vocab_size"], target)
