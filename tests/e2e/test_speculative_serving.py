"""Speculative decoding through real agents (speculative_config: n-gram drafts, the int8 self-draft,
a draft model): a batch of 8 with preemption forced gives token for token what plain decoding gives,
greedy, seeded, under a grammar and with penalties; drafts were proposed and kept, and the counters
say so."""
from __future__ import annotations

import numpy as np
import pytest

from common.grammar import from_regex
from llm_serving import LLM, SamplingParams
from tests.helpers import tiny_config

PROMPTS = ["abcabcabcabcabc", "the cat the cat the cat", "0101010101", "xyz", "hello hello hello",
           "one two three one two", "aaaa", "spec spec spec spec"]
SPEC = dict(spec_method="ngram", spec_tokens=3, spec_lookup_min=1, spec_lookup_max=3)


@pytest.fixture(scope="module")
def configs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("spec")
    # 47 blocks of 4 tokens hold 8 sequences of ~60 tokens only by preempting; 32 rows leave the
    # LM head room for drafts at batch 8.
    return tiny_config(tmp, tiny_model_dir, num_blocks=48, decode_batch_size=[1, 4, 8, 32])


def _run(config, params_list, **overrides):
    with LLM(str(config), **overrides) as llm:
        outs = [llm.generate(PROMPTS, params, progress=False) for params in params_list]
        return outs, llm.engine.metrics


PARAMS = [SamplingParams(max_new_tokens=40, ignore_eos=True),
          SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.1, top_p=0.9, seed=11),
          SamplingParams(max_new_tokens=24, grammar=from_regex("(ab|c)+x")),
          SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.05, logprobs=2)]


@pytest.fixture(scope="module")
def plain(configs):
    return _run(configs, PARAMS)[0]


@pytest.mark.parametrize("method", ["ngram", "self_int8", "draft"])
def test_drafts_change_no_token_in_a_preempted_batch(configs, plain, tiny_model_dir, method):
    spec = SPEC | {"spec_method": method}
    if method == "draft":  # the target's own folder as its draft: same tokenizer, every greedy draft right
        spec["spec_draft_model"] = str(tiny_model_dir)
    got, metrics = _run(configs, PARAMS, **spec)
    assert [[o.token_ids for o in outs] for outs in got] == [[o.token_ids for o in outs] for outs in plain]
    assert [[o.finish_reason for o in outs] for outs in got] == [[o.finish_reason for o in outs] for outs in plain]
    for outs, ref in zip(got, plain):  # a drafted position's logits come from a longer row: last bits may move
        assert all(np.allclose(o.logprobs, r.logprobs, atol=1e-4) for o, r in zip(outs, ref))
    value = metrics.registry.get_sample_value
    assert value("llm_serving_spec_accepted_tokens_total") > 0
    assert value("llm_serving_spec_draft_tokens_total") >= value("llm_serving_spec_accepted_tokens_total")
    assert value("llm_serving_preemptions_total") > 0
