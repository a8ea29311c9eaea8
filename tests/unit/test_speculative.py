"""The scheduler's side of speculative decoding: drafts on fed decodes within the budget and each
sequence's limits, nothing planned for a drafting sequence until its reply, rejected drafts rolled
back, and each sequence's k adapted to what its verifications kept."""
from __future__ import annotations

from common.config import ServingConfig
from server.sampling_params import SamplingParams
from server.sched.scheduler import Scheduler
from server.sched.sequence import Sequence
from server.sched.speculative import MAX_SKIP, SpecPolicy, SpecState
from server.sched.step_plan import RowResult


def _sched(num_blocks: int = 40, **kw) -> Scheduler:
    cfg = ServingConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, prefill_buckets=[16],
                        decode_buckets=[1, 4, 16], spec_method="ngram", spec_tokens=4, **kw).validate()
    return Scheduler(cfg, speculate=True)


def _decoding(s: Scheduler, prompt_len: int = 6, **params) -> Sequence:
    """A sequence whose prompt is in and its first token sampled: its next row is a fed decode."""
    seq = Sequence(list(range(1, prompt_len + 1)), SamplingParams(**params), 0.0)
    s.add(seq)
    while not seq.output:
        plan = s.schedule()
        s.update(plan, [RowResult([50] if p.sample else []) for p in plan.rows])
    return seq


def test_a_decode_carries_drafts_and_nothing_else_until_its_reply():
    s = _sched()
    seq = _decoding(s)
    plan = s.schedule()
    [p] = plan.rows
    assert (p.feed, p.spec, p.n_tokens, p.start) == (True, 4, 5, 6)
    assert len(seq.table) * 4 >= 6 + 5  # blocks for the fed token and every draft
    assert not s.schedule()  # its length is unknown until the reply
    s.update(plan, [RowResult([51, 52, 53], accepted=2, drafted=4)])  # two drafts kept, then its own sample
    assert seq.output == [50, 51, 52, 53] and seq.computed == 6 + 1 + 2 and seq.remaining == 1
    [p] = s.schedule().rows
    assert (p.start, p.spec) == (9, 3)  # asks for one more than it kept


def test_drafts_stop_at_max_tokens_and_the_context():
    s = _sched()
    seq = _decoding(s, max_new_tokens=3)  # 1 of 3 out: this row samples the 2nd, one draft may be the 3rd
    [p] = s.schedule().rows
    assert p.spec == 1
    s2 = _sched()
    long = _decoding(s2, prompt_len=60)  # 64-token context: positions 60..62 left for 1 + 2 drafts
    [p] = s2.schedule().rows
    assert p.seq is long and p.spec == 2 and seq.params.max_new_tokens == 3


def test_no_drafts_past_the_batch_limit_or_the_free_blocks():
    s = _sched(spec_max_batch=1)
    _decoding(s)
    _decoding(s)
    assert all(p.spec == 0 for p in s.schedule().rows)
    for prompt_len, drafts in ((6, 1), (7, 0)):  # its 2 blocks hold 8 tokens; nothing else is free
        tight = _sched()
        _decoding(tight, prompt_len)
        tight.blocks.grow([], tight.blocks.num_free * 4)
        [p] = tight.schedule().rows
        assert p.spec == drafts and tight.preempted == 0  # drafts take what is free, never preempt


def test_k_follows_what_the_verifications_kept():
    policy = SpecPolicy(ServingConfig(spec_method="ngram", spec_tokens=4))
    k, st = policy.wanted(None)
    assert k == 4
    policy.observe(st, 4, 1)
    assert policy.wanted(st)[0] == 2
    policy.observe(st, 2, 2)
    policy.observe(st, 3, 3)
    policy.observe(st, 4, 4)
    assert policy.wanted(st)[0] == 4  # capped at num_speculative_tokens
    policy.observe(st, 0, 0)  # nothing proposed: one plain decode, k kept
    assert [policy.wanted(st)[0] for _ in range(2)] == [0, 4]
    skips = []
    for _ in range(7):  # all rejected: no drafts for 1, 2, 4, ... decodes, then one more try
        policy.observe(st, 2, 0)
        skips.append(st.skip)
        while policy.wanted(st)[0] == 0:
            pass
    assert skips == [1, 2, 4, 8, 16, 16, 16] and MAX_SKIP == 16 and st.k == 1
    assert isinstance(st, SpecState)


def test_drafts_run_where_they_measured_faster_and_both_modes_are_measured_again():
    from server.sched.speculative import RUN, TRIAL
    policy = SpecPolicy(ServingConfig(spec_method="ngram"))

    def steps(n: int, on_rate: float, off_rate: float) -> list[bool]:
        modes = []
        for _ in range(n):
            modes.append(policy.allows(8))
            policy.observe_step(8, modes[-1], on_rate if modes[-1] else off_rate, 1.0)
        return modes

    assert steps(2 * TRIAL + RUN, 30, 20) == [True] * TRIAL + [False] * TRIAL + [True] * RUN  # drafts won
    assert steps(2 * TRIAL + RUN, 10, 20) == [True] * TRIAL + [False] * TRIAL + [False] * RUN  # now they lose
    assert policy.allows(9) and policy.trials[4].left == TRIAL - 1  # 9 is 8's class: its next round begins
    assert policy.allows(1) and 1 in policy.trials  # 1 measures for itself
    assert SpecPolicy(ServingConfig(spec_method="ngram", spec_max_batch=4)).allows(5) is False
