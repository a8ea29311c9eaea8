"""Liveness of the real Scheduler + BlockManager: every admitted request ends in a bounded number
of steps, whatever the pool, budget, buckets, lengths, arrivals and cancels; no block leaks."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.config import ServingConfig
from tests.helpers import results
from server.sampling_params import SamplingParams
from server.sched.scheduler import Scheduler
from server.sched.sequence import Sequence
from server.sched.step_plan import RowResult


def drive(s: Scheduler, requests: list[tuple[int, Sequence, int | None]], max_steps: int) -> int:
    """Run steps as the engine does; `requests` = (arrival step, sequence, cancel step or None).
    Returns the number of steps taken; fails if a step plans nothing while work is left."""
    pending = sorted(requests, key=lambda r: r[0])
    live: dict[int, tuple[Sequence, int | None]] = {}
    step = 0
    while pending or live:
        assert step < max_steps, f"not done after {max_steps} steps: {len(live)} live"
        while pending and pending[0][0] <= step:
            _, seq, cancel = pending.pop(0)
            assert s.fits(seq)
            s.add(seq)
            live[seq.seq_id] = (seq, cancel)
        for seq, cancel in list(live.values()):
            if cancel is not None and cancel <= step:
                s.remove(seq)
                del live[seq.seq_id]
        plan = s.schedule()
        if live:
            assert plan, f"step {step}: empty plan with {len(s.running)} running, {len(s.waiting)} waiting"
        s.update(plan, results([len(p.seq.output) % 3 if p.sample else None for p in plan.rows]))
        for p in plan.rows:
            if p.sample:
                seq = p.seq
                if len(seq.output) >= seq.params.max_new_tokens or len(seq.tokens) >= s.cfg.max_model_len:
                    s.remove(seq)
                    del live[seq.seq_id]
        step += 1
    return step


def assert_no_leak(s: Scheduler) -> None:
    assert not s.running and not s.waiting
    assert s.blocks.num_free == s.blocks.num_blocks - 1
    assert not any(s.blocks.refs)


def test_pool_smaller_than_one_sequence_is_rejected():
    """Audit trigger (a): a pool of 44 tokens under a 128-token context hung the first long prompt."""
    with pytest.raises(ValueError, match="less than one sequence"):
        ServingConfig(num_blocks=12, block_size=4, max_model_len=128, prefill_buckets=[32]).validate()


def test_two_prompts_that_each_fit_alone_both_finish():
    """Audit trigger (b): two 40-token prompts filled the pool mid-prefill and every later plan was empty."""
    cfg = ServingConfig(num_blocks=17, block_size=4, max_model_len=64, prefill_buckets=[16],
                        decode_buckets=[1, 2], max_prefill_rows=2, max_num_batched_tokens=32).validate()
    s = Scheduler(cfg)
    reqs = [(0, Sequence(list(range(i, i + 40)), SamplingParams(max_new_tokens=8), float(i)), None) for i in (0, 100)]
    drive(s, reqs, max_steps=200)
    assert s.preempted > 0
    assert_no_leak(s)


@st.composite
def scenarios(draw):
    bs = draw(st.integers(1, 8))
    max_len = draw(st.integers(4, 64))
    num_blocks = -(-max_len // bs) + 1 + draw(st.integers(0, 12))
    chunks = sorted(draw(st.sets(st.integers(1, max_len), min_size=1, max_size=3)))
    cfg = ServingConfig(num_blocks=num_blocks, block_size=bs, max_model_len=max_len, prefill_buckets=chunks,
                        decode_buckets=sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=3))),
                        max_prefill_rows=draw(st.integers(1, 4)),
                        max_num_batched_tokens=draw(st.sampled_from([0, 1, 3, 16, 64])),
                        schedule_policy=draw(st.sampled_from(["fcfs", "sjf"]))).validate()
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        plen = draw(st.integers(1, max_len - 1))
        # tokens from a tiny alphabet so prompts share prefixes (prefix cache hits and evictions)
        prompt = draw(st.lists(st.integers(0, 2), min_size=plen, max_size=plen))
        new = draw(st.integers(1, max_len - plen))
        cancel = draw(st.one_of(st.none(), st.integers(0, 40)))
        reqs.append((draw(st.integers(0, 20)), Sequence(prompt, SamplingParams(max_new_tokens=new), float(i)), cancel))
    return cfg, reqs


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_request_ends_and_no_block_leaks(scenario):
    cfg, reqs = scenario
    s = Scheduler(cfg)
    total = sum(len(q.prompt) + q.params.max_new_tokens for _, q, _ in reqs)
    drive(s, reqs, max_steps=40 + 20 * total)
    assert_no_leak(s)


def _next_token(history: list[int]) -> int:
    """The simulated model: a token from the whole history (4 plays EOS)."""
    return sum(t * (i + 1) for i, t in enumerate(history)) % 5


def _reference(seq: Sequence, max_len: int) -> list[int]:
    out: list[int] = []
    while True:
        out.append(_next_token(seq.prompt + out))
        if out[-1] == 4 or len(out) >= seq.params.max_new_tokens or len(seq.prompt) + len(out) >= max_len:
            return out


def drive_pipelined(s: Scheduler, requests: list[tuple[int, Sequence, int | None]], depth: int,
                    max_steps: int) -> dict[int, list[int]]:
    """The engine's pipeline against a simulated agent that runs steps in order from what was
    sent (tokens and block tables as of planning, fed rows from its own last samples) into a KV
    pool of slots, and samples `_next_token` of what it reads back through the block table. Up to
    `depth` steps in flight. Returns each sequence's output when it ended."""
    from collections import deque

    bs = s.cfg.block_size
    kv: dict[int, int] = {}
    last: dict[int, int] = {}

    def read(table: list[int], n: int) -> list[int]:
        return [kv[table[q // bs] * bs + q % bs] for q in range(n)]

    def run(sent: list) -> list[list[int]]:  # the agent: each row's emitted tokens
        outs = []
        for p, toks, table in sent:
            if p.feed:  # its last sample, then drafts: the true continuation, every third one wrong
                toks = [last[p.seq.seq_id]]
                for j in range(p.spec):
                    t = _next_token(read(table, p.start) + toks)
                    toks.append(t if (p.start + j + p.seq.seq_id) % 3 else (t + 1) % 5)
            for i, t in enumerate(toks):
                pos = p.start + i
                kv[table[pos // bs] * bs + pos % bs] = t
            emitted: list[int] = []
            for j in range(p.spec + 1) if p.sample else []:  # verify: keep drafts while they are what it samples
                emitted.append(_next_token(read(table, p.start + p.n_tokens - p.spec + j)))
                if j == p.spec or toks[j + 1] != emitted[-1]:
                    break
            if emitted:
                last[p.seq.seq_id] = emitted[-1]
            outs.append(emitted)
        return outs

    waiting = sorted(requests, key=lambda r: r[0])
    live: dict[int, tuple[Sequence, int | None]] = {}
    done: dict[int, list[int]] = {}
    inflight: deque = deque()  # (plan, what the agent got of each row)
    cancelled: set[int] = set()
    for step in range(max_steps):
        while waiting and waiting[0][0] <= step:
            _, seq, cancel = waiting.pop(0)
            s.add(seq)
            live[seq.seq_id] = (seq, cancel)
        for seq, cancel in list(live.values()):
            if cancel is not None and cancel <= step:
                if any(p.seq is seq for _, sent in inflight for p, _, _ in sent):
                    cancelled.add(seq.seq_id)
                else:
                    s.remove(seq)
                    done[seq.seq_id] = list(seq.output)
                    del live[seq.seq_id]
        while len(inflight) < depth and (plan := s.schedule()):
            sent = [(p, None if p.feed else p.seq.tokens[p.start:p.start + p.n_tokens], list(p.seq.table))
                    for p in plan.rows]
            assert all(t is None or len(t) == p.n_tokens for p, t, _ in sent), "a row needs a token not back yet"
            inflight.append((plan, sent))
        if not inflight:
            assert not live, f"step {step}: nothing planned with {len(live)} live"
            if not waiting:
                return done
            continue
        plan, sent = inflight.popleft()
        emitted = run(sent)
        s.update(plan, [RowResult(e if p.seq.seq_id in live and p.seq.seq_id not in cancelled else [],
                                  max(0, len(e) - 1), p.spec) for p, e in zip(plan.rows, emitted)])
        for p, out in zip(plan.rows, emitted):
            seq = p.seq
            if seq.seq_id not in live:
                continue  # ended while this step ran
            end = len(seq.output) if seq.seq_id in cancelled else None
            for n, token in enumerate([] if end is not None else out, len(seq.output) - len(out) + 1):
                if token == 4 or n >= seq.params.max_new_tokens or len(seq.prompt) + n >= s.cfg.max_model_len:
                    end = n  # delivered in order: the tokens after the one that ends it are dropped
                    break
            if end is not None:
                s.remove(seq)
                done[seq.seq_id] = list(seq.output[:end])
                del live[seq.seq_id]
    raise AssertionError(f"not done after {max_steps} steps")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([1, 2]), st.booleans())
def test_pipelined_steps_give_the_sequential_outputs(scenario, depth, speculate):
    """Overlap (depth 2: step N+1 planned before N's tokens are back, decodes fed by the agent)
    and depth 1, with and without drafts (a third of them wrong, their KV written and left stale),
    give every request the tokens of plain sequential generation, through preemption, recompute,
    prefix reuse and cancels (a cancelled one: a prefix of them); no block leaks."""
    cfg, reqs = scenario
    cfg.spec_tokens, cfg.spec_max_batch = 3, 0
    s = Scheduler(cfg, speculate=speculate)
    total = sum(len(q.prompt) + q.params.max_new_tokens for _, q, _ in reqs)
    done = drive_pipelined(s, reqs, depth, max_steps=40 + 20 * total)
    for _, seq, cancel in reqs:
        want = _reference(seq, cfg.max_model_len)
        got = done[seq.seq_id]
        assert got == want if cancel is None else got == want[:len(got)], (seq.prompt, got, want)
    assert_no_leak(s)
