"""The scheduler: chunked prefill, budgets, buckets, preemption, policies, the step layout and pacing."""
from __future__ import annotations

import numpy as np
import pytest

from common.config import ServingConfig
from tests.helpers import results
from server.sampling_params import SamplingParams
from server.sched.scheduler import Scheduler
from server.sched.sequence import Sequence


def _cfg(**kw) -> ServingConfig:
    c = ServingConfig(num_blocks=9, block_size=4, max_model_len=32, prefill_buckets=[8],
                      decode_buckets=[1, 4], max_prefill_rows=2, **kw)
    return c.validate()


def test_scheduler_chunks_long_prompts_and_puts_decodes_first():
    s = Scheduler(_cfg(max_num_batched_tokens=10))
    a = Sequence(list(range(16)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 10, False)]  # chunk = the budget
    s.update(plan, results([None]))
    b = Sequence([1, 2, 3], SamplingParams(), 1.0)
    s.add(b)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 6, True), (b, 3, True)]  # packed together
    s.update(plan, results([7, 9]))
    assert a.output == [7] and b.output == [9] and a.pending == b.pending == 0
    c = Sequence(list(range(100, 120)), SamplingParams(), 2.0)
    s.add(c)
    plan = s.schedule()
    assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 1, True), (b, 1, True), (c, 8, False)]


def test_scheduler_uses_the_prefill_only_budget_while_nothing_decodes():
    s = Scheduler(ServingConfig(num_blocks=20, block_size=4, max_model_len=32, decode_buckets=[1, 4],
                                max_num_batched_tokens=10, prefill_only_tokens=20).validate())
    a = Sequence(list(range(30)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(20, False)]
    s.update(plan, results([None]))
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(10, True)]
    s.update(plan, results([5]))
    b = Sequence(list(range(100, 130)), SamplingParams(), 1.0)
    s.add(b)
    plan = s.schedule()  # a decodes now: the mixed budget
    assert [(p.seq, p.n_tokens) for p in plan.rows] == [(a, 1), (b, 9)]


def test_scheduler_ends_a_step_at_a_bucket_rather_than_pad_most_of_the_next():
    cfg = ServingConfig(num_blocks=64, block_size=16, max_model_len=512, prefill_buckets=[128, 256],
                        decode_buckets=[1, 4]).validate()
    assert cfg.token_buckets == [1, 4, 16, 64, 128, 256]
    s = Scheduler(cfg)
    a = Sequence(list(range(141)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()  # 141 would pad to 256: 128 now, the 13 left next
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(128, False)]
    s.update(plan, results([None]))
    plan = s.schedule()
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(13, True)]
    s.update(plan, results([5]))
    assert a.output == [5] and a.computed == 141
    for n in (200, 70):  # with a's decode: cutting 73 would save 55; cutting 7 saves 57, less than a step costs
        b = Sequence(list(range(100 * n, 101 * n)), SamplingParams(max_new_tokens=1), 1.0)
        s.add(b)
        plan = s.schedule()
        assert [(p.seq, p.n_tokens, p.sample) for p in plan.rows] == [(a, 1, True), (b, n, True)]
        s.update(plan, results([6, 7]))
        s.remove(b)


def test_scheduler_keeps_a_prompt_whole_where_the_agent_skips_padding():
    cfg = ServingConfig(num_blocks=64, block_size=16, max_model_len=512, prefill_buckets=[128, 256],
                        decode_buckets=[1, 4]).validate()
    s = Scheduler(cfg, pads_cost=False)
    a = Sequence(list(range(141)), SamplingParams(), 0.0)
    s.add(a)
    plan = s.schedule()  # padding to 256 is free here: the whole prompt, sampled in this step
    assert [(p.n_tokens, p.sample) for p in plan.rows] == [(141, True)]


def test_scheduler_preempts_newest_when_blocks_run_out():
    s = Scheduler(_cfg())  # 8 usable blocks of 4 tokens
    seqs = [Sequence(list(range(i * 10, i * 10 + 8)), SamplingParams(), float(i)) for i in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(3):  # the 8-token budget admits one prompt per step
        s.update(s.schedule(), results([None]))
    assert len(s.running) == 3 and s.blocks.num_free == 2
    for q in seqs:
        q.output.append(1)  # each now needs a third block for its next token
    plan = s.schedule()
    assert s.preempted == 1 and plan.preempted == 1 and seqs[2] in s.waiting and seqs[2].computed == 0
    assert [p.seq for p in plan.rows] == seqs[:2]


def test_a_scored_prompt_runs_in_chunks_that_fit_the_lm_head_rows_and_skips_the_prefix_cache():
    """Prompt logprobs: a scored row's tokens are LM-head rows too, so with one decode riding its
    chunk is at most max_running (4) - 1 tokens, nothing is planned after it, its targets are the
    prompt's next tokens (none for the last) and a prefix-cache hit is not taken (no logits there)."""
    s = Scheduler(ServingConfig(num_blocks=20, block_size=4, max_model_len=32, prefill_buckets=[8],
                                decode_buckets=[1, 4], max_prefill_rows=2, enable_prefix_caching=True).validate())
    prompt = list(range(10, 20))
    a = Sequence(prompt + [1], SamplingParams(), 0.0)
    s.add(a)
    s.update(s.schedule(), results([None]))
    s.update(s.schedule(), results([5]))  # a's blocks are published; a decodes from now on
    b = Sequence(prompt + [2], SamplingParams(prompt_logprobs=2), 1.0)
    c = Sequence([1, 2], SamplingParams(), 2.0)
    s.add(b)
    s.add(c)
    got, starts = [], []
    while b.scoring:
        plan = s.schedule()
        mine = [p for p in plan.rows if p.seq is b]
        if mine:
            p = mine[0]
            assert plan.rows[-1] is p and p.n_tokens <= 3 and plan.rows[0].seq is a
            assert p.targets == b.prompt[p.start + 1:p.start + 1 + len(p.targets)]
            starts.append(p.start)
            got += p.targets
            b.scores.update({p.start + 1 + k: None for k in range(len(p.targets))})
        s.update(plan, results([7 if q.sample else None for q in plan.rows]))
    assert got == b.prompt[1:] and starts[0] == 0 and len(starts) >= 4


def test_sjf_policy_orders_by_max_new_tokens():
    s = Scheduler(_cfg(schedule_policy="sjf"))
    long_, short = (Sequence([1, 2], SamplingParams(max_new_tokens=n), float(i)) for i, n in enumerate((50, 5)))
    s.add(long_)
    s.add(short)
    assert s.schedule().rows[0].seq is short


def test_write_step_lays_out_rows_and_slots():
    """Mixed prefill chunk (crossing blocks), decodes and sampling params land where the agent reads."""
    from shm.arena import Arena, ArenaSpec
    from shm.step import RowInput, StepDims

    arena = Arena.private(ArenaSpec(16, 4, 8))
    hot = SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2)
    rows = [RowInput(7, np.array([5, 6, 7, 8, 9], np.int32), 2, [3, 9], True, hot, 7, 0),
            RowInput(8, np.array([4], np.int32), 9, [1, 2, 6], True, SamplingParams(), 3, 7),
            RowInput(9, np.array([1, 2], np.int32), 0, [5], False, SamplingParams(), 4, 0)]
    assert arena.write_step(rows, 4) == StepDims(8, 3, 3)
    x, c = arena.full.inputs, arena.full.sampling
    assert x.tokens[:8].tolist() == [5, 6, 7, 8, 9, 4, 1, 2]
    assert x.positions[:8].tolist() == [2, 3, 4, 5, 6, 9, 0, 1]
    # slot = table[pos // 4] * 4 + pos % 4
    assert x.slots[:8].tolist() == [14, 15, 36, 37, 38, 25, 20, 21]
    assert x.query_lens[:3].tolist() == [5, 1, 2]
    assert x.block_tables[:3, :3].tolist() == [[3, 9, 0], [1, 2, 6], [5, 0, 0]]
    assert x.seq_ids[:3].tolist() == [7, 8, 9] and x.sample[:3].tolist() == [1, 1, 0]
    assert c.output_len[:3].tolist() == [0, 7, 0] and c.seed[:3].tolist() == [11, -1, -1]
    assert np.allclose(c.temperature[:2], [0.7, SamplingParams().temperature])
    assert c.top_k[0] == 5 and c.n_logprobs[0] == 2


def test_prefill_batch_window_holds_an_idle_lane_briefly():
    from server.sched.scheduler import Scheduler
    from server.sched.sequence import Sequence

    cfg = ServingConfig(prefill_batch_waiting_time=0.05, max_prefill_rows=2)
    s = Scheduler(cfg)
    assert s.batch_hold(0.0) == 0.0  # nothing waits
    s.add(Sequence([1, 2, 3], SamplingParams(max_new_tokens=4), arrival=10.0))
    assert s.batch_hold(10.01) == pytest.approx(0.04)  # a lone prompt waits for a companion...
    assert s.batch_hold(10.06) == 0.0  # ...never past the window
    s.add(Sequence([4, 5], SamplingParams(max_new_tokens=4), arrival=10.02))
    assert s.batch_hold(10.03) == 0.0  # a full prefill batch goes at once
    assert ServingConfig().prefill_batch_waiting_time == 0.0  # off by default


def test_retry_after_follows_the_queue_and_recent_throughput():
    from server.engine.requests import RETRY_AFTER_MAX_S, drain_eta_s

    assert drain_eta_s(50, []) == 1  # nothing finished yet: unknown
    assert drain_eta_s(50, [0.0, 1.0, 2.0, 3.0, 4.0]) == 50  # one request a second
    assert drain_eta_s(50, [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) == 5  # ten a second
    assert drain_eta_s(10**6, [0.0, 100.0]) == RETRY_AFTER_MAX_S


def test_step_pacer_sends_the_next_step_shortly_before_the_one_in_flight_is_due():
    from server.engine.pacing import EARLY, LEAD_S, StepPacer

    p = StepPacer([16, 64])
    assert p.wait_s(10, started=5.0, now=5.0) == 0.0  # a bucket never timed: send at once
    p.observe(10, 0.2)
    assert abs(p.wait_s(12, 5.0, 5.0) - (0.2 * (1 - EARLY) - LEAD_S)) < 1e-9  # same bucket (16)
    assert p.wait_s(12, 5.0, 5.2) == 0.0 and p.wait_s(40, 5.0, 5.0) == 0.0  # due now; bucket 64 untimed
    p.observe(16, 0.1)
    assert abs(p.took[16] - 0.175) < 1e-9  # a running mean, not the last step alone
