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

from server.block_manager import BlockManager
from common.config import ServingConfig
from server.kv_handover import HandoverSlots, KvMoves
from server.sequence import Sequence
from server.speculation import SpecPolicy
from server.step_plan import RowResult, StepBuilder, StepPlan, commit, end_at_bucket


def _order_key(seq: Sequence, policy: str) -> tuple:
    """Waiting sequences' order: preempted ones first, then by the policy."""
    if policy == "sjf":  # shortest max_new_tokens first (contest write-ups)
        return (-seq.preemptions, seq.params.max_new_tokens, seq.arrival)
    if policy == "priority":
        return (-seq.preemptions, seq.params.priority, seq.arrival)
    return (-seq.preemptions, seq.arrival)


class Scheduler(KvMoves):
    def __init__(self, cfg: ServingConfig, pads_cost: bool = True, speculate: bool = False, role: str = "both",
                 handover: HandoverSlots | None = None):
        """`speculate`: decodes ask the agent for drafts (its proposer is speculative_config's). `role`
        (serving_config.agent_roles): a `prefill` agent's finished prompts leave with their KV through
        `handover`'s slots (`exporting` until the step's reply), to a `decode` agent that takes them
        in (`incoming`) and never runs a prompt."""
        self.cfg, self.role, self.handover = cfg, role, handover
        self.spec = SpecPolicy(cfg) if speculate else None
        # Whether the agent computes a step's padding (AgentInfo.pads_cost): where it skips it, cutting
        # a prompt to a bucket only splits it, and its tail waits for the next, often larger, step.
        self.pads_cost = pads_cost
        # the prefix keys' root: what besides the tokens changes a block's KV
        salt = f"{cfg.model_name}|{cfg.model_path}|{cfg.model_cfg_path}|{cfg.model_dtype}|{cfg.kv_cache_dtype}"
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, salt)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.max_running = cfg.max_running
        self.preempted = 0  # total preemptions, for metrics
        self.freed: list[int] = []  # ended since the last plan that was sent
        self.exporting: list[Sequence] = []  # their KV on its way out (a prefill agent's prompts, a drain)
        self.incoming: list[Sequence] = []  # handed to this agent, their KV in the hand-over slots
        self.draining = False  # every sequence leaves with its KV; nothing new comes (POST /admin/agents/{port}/drain)
        self.discarded = 0  # KV tokens thrown away by preemption, to be computed again
        self.moved = 0  # sequences that left with their KV

    @property
    def active(self) -> int:
        """Sequences admitted here: running, and those whose KV is on its way out or in."""
        return len(self.running) + len(self.exporting) + len(self.incoming)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV its sequences hold here (planned steps included)."""
        return sum(seq.computed for seq in self.running + self.exporting + self.incoming)

    @property
    def load(self) -> int:
        return len(self.waiting) + self.active

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence, free its blocks and tell the agent with the next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.incoming:
            self.incoming.remove(seq)
            self.handover.give(seq.handover)
        elif seq in self.exporting:  # its slots are given back at its step's reply (the agent writes them)
            self.exporting.remove(seq)
        self.blocks.release(seq.table)
        self.freed.append(seq.seq_id)

    def drain(self) -> list[Sequence]:
        """Take every sequence out (their agent died); their KV state is lost."""
        seqs = self.running + self.waiting + self.exporting + self.incoming
        for s in self.exporting + self.incoming:  # the agent is gone: nobody reads or writes their slots
            self.handover.give(s.handover)
        self.running, self.waiting, self.exporting, self.incoming = [], [], [], []
        for s in seqs:  # tokens in flight are lost with the agent
            s.table, s.computed, s.pending, s.agent_has_next = [], 0, 0, False
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        self.discarded += seq.computed
        seq.computed = 0
        seq.preemptions += 1
        self.preempted += 1
        self.waiting.insert(0, seq)

    def fits(self, seq: Sequence) -> bool:
        """Whether the sequence at its longest (prompt + max_new_tokens) fits the pool alone: what
        guarantees that preempting everything newer always lets the oldest sequence finish."""
        longest = min(len(seq.prompt) + seq.params.max_new_tokens, self.cfg.max_model_len)
        return self.blocks.blocks_needed([], longest) <= self.blocks.num_blocks - 1

    def _reserve(self, seq: Sequence, length: int, step: StepBuilder) -> bool:
        """Grow `seq` to `length` tokens, preempting the newest running sequences until it fits;
        False if `seq` itself was the newest and got preempted. The oldest running sequence never
        waits on a younger one, so every admitted sequence finishes (nothing stalls with an empty plan)."""
        while not self.blocks.grow(seq.table, length):
            victim = self.running[-1]
            self._preempt(victim)
            step.drop(victim)
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
        """The next step: decodes first, then chunks of started prompts, then new prompts."""
        if self.draining:
            return self._plan_drain()
        preempted, discarded = self.preempted, self.discarded
        # Prefill runs faster per token in larger steps on AVX-512 (docs/perf-notes.md), but a larger
        # step delays every decode riding in it: the larger budget only while nothing decodes.
        decoding = any(seq.remaining == 1 for seq in self.running)
        step = StepBuilder(self.cfg, self.cfg.token_budget if decoding else self.cfg.prefill_budget)
        self._plan_decodes(step)
        self._plan_imports(step)
        if self.role != "decode":
            self._plan_started(step)
            self._plan_admissions(step)
        drafting = (self.spec is not None and any(p.feed and p.sample for p in step.rows)
                    and self.spec.allows(len(self.running)))
        if drafting:
            self._plan_drafts(step)
        if self.pads_cost:
            end_at_bucket(step.rows, self.cfg.token_buckets)
        if self.role == "prefill":
            self._plan_exports(step)
        commit(step.rows)
        plan = StepPlan(step.rows, self.freed if step.rows else [], self.preempted - preempted, len(self.running),
                        drafting, discarded=self.discarded - discarded)
        if step.rows:
            self.freed = []
        return plan

    def _plan_decodes(self, step: StepBuilder) -> None:
        for seq in list(self.running):  # oldest first
            if (seq in self.running and seq.remaining == 1 and not seq.at_limit(self.cfg.max_model_len)
                    and self._reserve(seq, seq.computed + 1, step)):
                step.add_decode(seq)

    def _plan_started(self, step: StepBuilder) -> None:
        for seq in list(self.running):  # prompts already started, oldest first
            if not step.open:
                break
            n = step.chunk(seq) if seq in self.running and seq.remaining > 1 else 0
            if n > 0 and self._reserve(seq, seq.computed + n, step):
                step.add_chunk(seq, n)

    def _plan_admissions(self, step: StepBuilder) -> None:
        """New prompts, in policy order, while blocks last. A preempted sequence whose sampled token is
        still in flight waits for it: recomputing without it would sample that token a second time."""
        self.waiting.sort(key=lambda seq: _order_key(seq, self.cfg.schedule_policy))
        for seq in [seq for seq in self.waiting if not seq.pending]:
            if not step.open or len(self.running) >= self.max_running:
                break
            if not seq.table and not seq.scoring:
                seq.table = self.blocks.match_prefix(seq.tokens, seq.params.adapter_key)
                seq.computed = len(seq.table) * self.cfg.block_size
            if seq.cached_tokens is None:
                seq.cached_tokens = seq.computed
            n = step.chunk(seq)
            if n <= 0 or not self.blocks.grow(seq.table, seq.computed + n):
                self.blocks.release(seq.table)
                seq.computed = 0
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            step.add_chunk(seq, n, admitted=True)

    def _plan_drafts(self, step: StepBuilder) -> None:
        """Drafts on the step's fed decodes, oldest first, within the step's token budget, the
        graph's LM-head rows (every draft is scored), each sequence's length limits and the free
        blocks (a draft never preempts anyone). Nothing is planned for a drafting sequence until its
        reply says how many drafts held (its `remaining` is below 1 meanwhile)."""
        if any(seq.scoring for seq in self.running):  # scored prompt tokens take the LM-head rows
            return
        room = min(step.tokens, self.cfg.max_running - len(step.rows))
        for p in [p for p in step.rows if p.feed and p.sample]:
            seq = p.seq
            want, seq.spec = self.spec.wanted(seq.spec)
            n_out = len(seq.output) + seq.pending
            free = (len(seq.table) + self.blocks.num_free) * self.cfg.block_size - seq.computed - 1
            k = min(want, room, free, seq.params.max_new_tokens - n_out - 1, self.cfg.max_total_tokens - seq.computed - 2)
            if k > 0 and self.blocks.grow(seq.table, seq.computed + 1 + k):
                step.add_drafts(p, k)
                room -= k

    def update(self, plan: StepPlan, results: list[RowResult]) -> None:
        """A step's reply: its samples are no longer pending, a drafting row's rejected drafts leave
        the cache (`computed`), each row's tokens are appended, and the full blocks it computed are
        published for prefix reuse."""
        for p, res in zip(plan.rows, results, strict=True):
            seq = p.seq
            seq.pending -= p.sample
            rejected = p.spec - res.accepted
            if p.spec and p.epoch == seq.preemptions:
                seq.computed -= rejected  # their K/V are overwritten by the next tokens there
                if self.spec is not None and seq.spec is not None:
                    self.spec.observe(seq.spec, res.drafted, res.accepted)
            seq.output.extend(res.tokens)
            if p.epoch == seq.preemptions and seq.table:
                self.blocks.register_full(seq.table, seq.tokens, p.start + p.n_tokens - rejected, seq.block_hashes,
                                         seq.params.adapter_key)
