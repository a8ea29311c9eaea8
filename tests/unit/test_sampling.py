"""Agent sampler: no accepted parameter value makes NaN or inf, and a row that fails anyway fails alone."""
from __future__ import annotations

import numpy as np

from agent.sampling import sample
from shm.step import SamplingColumns


def _rows(n: int, **cols) -> SamplingColumns:
    base = dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                min_p=np.zeros(n, np.float32), repetition_penalty=np.ones(n, np.float32),
                presence_penalty=np.zeros(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                seed=np.full(n, 7, np.int64), n_logprobs=np.zeros(n, np.int32), prompt_len=np.full(n, 2, np.int32),
                output_len=np.zeros(n, np.int32), n_prompt_logprobs=np.zeros(n, np.int32))
    return SamplingColumns(**{k: np.asarray(cols.get(k, v), v.dtype) for k, v in base.items()})


def test_extreme_values_sample_finite_tokens_and_a_broken_row_fails_alone():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 50)).astype(np.float32) * 4
    logits[3, 7] = np.nan  # a row the model broke
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(np.float32)
    params = _rows(5, temperature=[0.0, 1.0, 1e-30, 0.8, 3e38], repetition_penalty=[1.0, 1e-40, 1.0, 1.0, 3e38],
                   top_k=[0, 0, 0, 0, 2**31 - 1], n_logprobs=[0, 2, 0, 0, 3])
    hist = [None, np.array([1, 2, 3]), None, None, np.array([4, 5])]
    greedy = int(np.argmax(logits[0]))
    res = sample(logits.copy(), lse, params, hist, rng)
    assert res.ids[0] == greedy
    assert res.ids[2] == int(np.nanargmax(logits[2]))  # a temperature below 1e-5 is greedy
    assert res.ids[3] == -1  # failed alone
    assert all(0 <= res.ids[r] < 50 for r in (0, 1, 2, 4))
    assert np.isfinite(res.logprobs[[0, 1, 2, 4]]).all()
    assert np.isfinite(res.top_logprobs[[1, 4]]).all()


def test_all_greedy_fast_path_matches_the_general_path():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 4
    logits[2, 9] = np.nan
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(np.float32)
    fast = sample(logits.copy(), lse, _rows(4), [None] * 4, rng)
    general = sample(logits.copy(), lse, _rows(4, n_logprobs=[0, 0, 0, 1]), [None] * 4, rng)  # logprobs: general path
    assert fast.ids.tolist() == general.ids.tolist() and fast.ids[2] == -1
    assert np.allclose(fast.logprobs[[0, 1, 3]], general.logprobs[[0, 1, 3]])


def test_top_p_and_min_p_on_a_vocabulary_smaller_than_the_candidate_set():
    """A 50-token vocabulary is below the 256 candidates top-p starts from: every token is one
    (it used to fail every such row)."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 50)).astype(np.float32)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(np.float32)
    res = sample(logits.copy(), lse, _rows(2, temperature=[1.0, 1.0], top_p=[0.9, 1.0], min_p=[0.0, 0.1]),
                 [None, None], rng)
    assert all(0 <= t < 50 for t in res.ids)
