"""Token-budget continuous-batching scheduler for one agent (one KV cache).

Each step: decodes first, then running chunked prefills, then new prompts, within a token budget
(Dynamic SplitFuse: long prompts are split into chunks, short ones fused into one step). When KV
blocks run out for a decode or a chunk, the most recently admitted sequence is preempted and later
recomputed. Liveness: every sequence fits the pool alone (`fits`, checked at admission), so the
oldest running one always progresses and a plan is empty only when nothing is left to run (or
everything left waits on a step in flight).

Overlap: a plan advances `computed` when it is made, not when its reply comes, and counts each
sampled row as a `pending` token until its reply; so step N+1 can be planned while step N runs.
A decode whose input is such a pending token is a *fed* row: the agent takes its own last sample.

The scheduler alone mutates a Sequence: `schedule()` plans (`StepPlan`), `update(plan, sampled)`
takes a step's reply and appends its tokens, `remove` ends one.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.block_manager import BlockManager
from common.config import ServingConfig
from server.sampling_params import SamplingParams
from shm.step import RowOutput

if TYPE_CHECKING:  # server.request imports this module
    from server.request import Request

_ids = itertools.count(1)
# A step pads to its token bucket, and padding costs as much as tokens (SmolLM2 fp32 on 2 Zen 3
# cores, 8 decodes riding: 128 tokens 277 ms, 256 tokens 545 ms, ~2 ms a token) while a step's
# fixed cost is worth ~40-60 tokens (16 tokens: 91 ms). So a step just past a bucket gives its last
# chunk's overflow to the next step, when that saves at least this much padding.
MIN_TRIMMED_PADDING = 64


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    arrival: float
    request: "Request | None" = None  # the engine's request record
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain keys of full blocks, grown as computed
    preemptions: int = 0
    pending: int = 0  # sampled in steps in flight, not yet back
    agent_has_next: bool = False  # its last planned row sampled: the agent holds its next input token
    scores: dict[int, RowOutput] = field(default_factory=dict)  # prompt logprobs: position -> its token's score

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def scoring(self) -> bool:
        """Its prompt's logprobs are asked and not all back yet: its rows score, and it is computed in
        full (no prefix-cache hit: a cached block has no logits)."""
        return self.params.prompt_logprobs is not None and len(self.scores) < len(self.prompt) - 1

    def targets(self, start: int, n: int) -> list[int]:
        """The next prompt token of each token of a row from position `start` while scoring (the
        prompt's last token has none: what follows it is sampled)."""
        return self.prompt[start + 1:min(start + n, len(self.prompt) - 1) + 1] if self.scoring else []

    @property
    def remaining(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending - self.computed

    def at_limit(self, max_model_len: int) -> bool:
        """Its tokens in flight already end it by length (max_new_tokens or the context): no more rows."""
        n_out = len(self.output) + self.pending
        return self.pending > 0 and (n_out >= self.params.max_new_tokens
                                     or len(self.prompt) + n_out >= max_model_len)


@dataclass
class Planned:
    seq: Sequence
    n_tokens: int
    sample: bool
    feed: bool = False  # a decode whose input token is the agent's own last sample for this sequence
    start: int = 0  # position of the row's first token (the sequence's `computed` when planned)
    output_len: int = 0  # tokens the sequence had generated before this row's sample (in flight included)
    epoch: int = 0  # the sequence's preemptions when planned: its blocks are still the same while equal
    admitted: bool = False  # its first row since it was (re)admitted: the agent gets its grammar again
    targets: list[int] = field(default_factory=list)  # the prompt tokens its first tokens are scored against


@dataclass
class StepPlan:
    """One step: its rows, the sequences ended since the last step (the agent drops their state),
    and how many sequences planning it preempted."""
    rows: list[Planned]
    freed: list[int] = field(default_factory=list)
    preempted: int = 0

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def has_prefill(self) -> bool:
        """Some row carries tokens (`*`); else every row is fed by the agent's last sample (`a`)."""
        return not all(p.feed for p in self.rows)

    @property
    def prefill_tokens(self) -> int:
        return sum(p.n_tokens for p in self.rows if p.start < len(p.seq.prompt))


def score_room(plan: list[Planned], cfg: ServingConfig) -> int:
    """Most tokens of a scored row in this step: its scored tokens share the graph's LM-head rows
    with every row's last token (at most max_running of them, in a step of at most the mixed
    budget, agent/runner_config.py); nothing is planned after it."""
    return min(cfg.max_running - len(plan), cfg.mixed_step_tokens - sum(p.n_tokens for p in plan))


def end_at_bucket(plan: list[Planned], buckets: list[int]) -> None:
    """Cut the last prefill chunk so the step fills the bucket below instead of padding most of
    the one above: only when the cut is smaller than the padding saved (the cut tokens pad a later
    step at most that much) and the saving beats a step's fixed cost. E.g. a 141-token prompt
    alone: 128 + 13 tokens in two steps (~340 ms) instead of 141 padded to 256 (545 ms)."""
    total = sum(p.n_tokens for p in plan)
    above = next((b for b in buckets if b >= total), total)
    below = max((b for b in buckets if b < total), default=0)
    cut, padding = total - below, above - total
    last = plan[-1] if plan else None
    if last and below and cut < last.n_tokens and cut < padding and padding >= MIN_TRIMMED_PADDING:
        last.n_tokens -= cut  # its blocks stay reserved for the next step
        last.sample = False


class Scheduler:
    def __init__(self, cfg: ServingConfig, pads_cost: bool = True):
        self.cfg = cfg
        # Whether the agent computes a step's padding (AgentInfo.pads_cost): where it skips it, cutting
        # a prompt to a bucket only splits it, and its tail waits for the next, often larger, step
        # (a 289-token prompt after 3 decodes: 253 + 36 tokens, first token 1.0 s instead of ~0.4).
        self.pads_cost = pads_cost
        # the prefix keys' root: what besides the tokens changes a block's KV
        salt = f"{cfg.model_name}|{cfg.model_path}|{cfg.model_cfg_path}|{cfg.model_dtype}|{cfg.kv_cache_dtype}"
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, salt)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.max_running = cfg.max_running
        self.preempted = 0  # total preemptions, for metrics
        self.freed: list[int] = []  # ended since the last plan that was sent

    def _order_key(self, seq: Sequence) -> tuple:
        if self.cfg.schedule_policy == "sjf":  # shortest max_new_tokens first (contest write-ups)
            return (-seq.preemptions, seq.params.max_new_tokens, seq.arrival)
        if self.cfg.schedule_policy == "priority":
            return (-seq.preemptions, seq.params.priority, seq.arrival)
        return (-seq.preemptions, seq.arrival)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence, free its blocks and tell the agent with the next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)
        self.freed.append(seq.seq_id)

    def drain(self) -> list[Sequence]:
        """Take every sequence out (their agent died); their KV state is lost."""
        seqs = self.running + self.waiting
        self.running, self.waiting = [], []
        for s in seqs:  # tokens in flight are lost with the agent
            s.table, s.computed, s.pending, s.agent_has_next = [], 0, 0, False
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.computed = 0
        seq.preemptions += 1
        self.preempted += 1
        self.waiting.insert(0, seq)

    def fits(self, seq: Sequence) -> bool:
        """Whether the sequence at its longest (prompt + max_new_tokens) fits the pool alone: what
        guarantees that preempting everything newer always lets the oldest sequence finish."""
        longest = min(len(seq.prompt) + seq.params.max_new_tokens, self.cfg.max_model_len)
        return self.blocks.blocks_needed([], longest) <= self.blocks.num_blocks - 1

    def _reserve(self, seq: Sequence, length: int, plan: list[Planned]) -> bool:
        """Grow `seq` to `length` tokens, preempting the newest running sequences until it fits;
        False if `seq` itself was the newest and got preempted. The oldest running sequence never
        waits on a younger one, so every admitted sequence finishes (nothing stalls with an empty plan)."""
        while not self.blocks.grow(seq.table, length):
            victim = self.running[-1]
            self._preempt(victim)
            plan[:] = [p for p in plan if p.seq is not victim]
            if victim is seq:
                return False
        return True

    def batch_hold(self, now: float) -> float:
        """Seconds to hold the first prefill of an idle lane for companions (the original's
        `prefill_batch_waiting_time`): only while nothing runs and fewer than prefill_batch_size
        prompts wait, and never past the window from the oldest arrival. 0: schedule now."""
        window = self.cfg.prefill_batch_waiting_time
        if window <= 0 or self.running or not self.waiting or len(self.waiting) >= self.cfg.max_prefill_rows:
            return 0.0
        return max(0.0, min(s.arrival for s in self.waiting) + window - now)

    def schedule(self) -> StepPlan:
        preempted = self.preempted
        plan: list[Planned] = []
        # Prefill ran ~30% faster per token in 512- than in 256-token steps on an AVX-512 Xeon (flat on
        # an AVX2 Zen 3), but a larger step delays every decode riding in it: the larger budget only
        # while nothing decodes.
        decoding = any(seq.remaining == 1 for seq in self.running)
        budget = self.cfg.token_budget if decoding else self.cfg.prefill_budget
        for seq in list(self.running):  # 1. decodes, oldest first
            if (seq in self.running and seq.remaining == 1 and not seq.at_limit(self.cfg.max_model_len)
                    and self._reserve(seq, seq.computed + 1, plan)):
                plan.append(Planned(seq, 1, True, feed=seq.agent_has_next))
                budget -= 1
        prefill_rows = 0
        for seq in list(self.running):  # 2. chunks of prompts already started, oldest first
            if budget <= 0 or prefill_rows >= self.cfg.max_prefill_rows:
                break
            if seq not in self.running or seq.remaining <= 1:
                continue
            n = min(seq.remaining, budget, score_room(plan, self.cfg) if seq.scoring else budget)
            if n > 0 and self._reserve(seq, seq.computed + n, plan):
                plan.append(Planned(seq, n, n == seq.remaining))
                budget = 0 if seq.scoring else budget - n
                prefill_rows += 1
        self.waiting.sort(key=self._order_key)
        # A preempted sequence whose sampled token is still in flight waits for it: recomputing
        # without it would sample that token a second time.
        ready = [seq for seq in self.waiting if not seq.pending]
        while (ready and budget > 0 and prefill_rows < self.cfg.max_prefill_rows
               and len(self.running) < self.max_running):  # 3. admit new prompts while blocks last
            seq = ready[0]
            if not seq.table and not seq.scoring:
                seq.table = self.blocks.match_prefix(seq.tokens)
                seq.computed = len(seq.table) * self.cfg.block_size
            n = min(seq.remaining, budget, score_room(plan, self.cfg) if seq.scoring else budget)
            if n <= 0 or not self.blocks.grow(seq.table, seq.computed + n):
                self.blocks.release(seq.table)
                seq.computed = 0
                break
            self.waiting.remove(ready.pop(0))
            self.running.append(seq)
            plan.append(Planned(seq, n, n == seq.remaining, admitted=True))
            budget = 0 if seq.scoring else budget - n
            prefill_rows += 1
        if self.pads_cost:
            end_at_bucket(plan, self.cfg.token_buckets)
        for p in plan:  # the plan is final: its rows count as computed, its samples as pending
            seq = p.seq
            p.start, p.output_len, p.epoch = seq.computed, len(seq.output) + seq.pending, seq.preemptions
            p.targets = seq.targets(p.start, p.n_tokens)
            seq.computed += p.n_tokens
            seq.pending += p.sample
            seq.agent_has_next = p.sample
        step = StepPlan(plan, self.freed if plan else [], self.preempted - preempted)
        if plan:
            self.freed = []
        return step

    def update(self, plan: StepPlan, sampled: list[int | None]) -> None:
        """A step's reply: its samples are no longer pending, the full blocks it computed are
        published for prefix reuse, and each row's token (None: none to keep) is appended."""
        for p, token in zip(plan.rows, sampled, strict=True):
            p.seq.pending -= p.sample
            if p.epoch == p.seq.preemptions and p.seq.table:
                self.blocks.register_full(p.seq.table, p.seq.tokens, p.start + p.n_tokens, p.seq.block_hashes)
            if token is not None:
                p.seq.output.append(token)
