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

from server.sched.block_manager import BlockManager
from common.config import ServingConfig
from common.config_values import Role
from server.sched.handover import HandoverSlots, KvMoves
from server.sched.sequence import Sequence
from server.sched.speculative import SpecPolicy
from server.sched.step_plan import (RowResult, StepBuilder, StepPlan, batch_hold, commit, end_at_bucket, plan_admissions,
                              record_reply)


class Scheduler:
    def __init__(self, cfg: ServingConfig, pads_cost: bool = True, speculate: bool = False, role: Role = Role.BOTH,
                 handover: HandoverSlots | None = None):
        """`speculate`: decodes ask the agent for drafts (its proposer is speculative_config's). `role`
        (serving_config.agent_roles): a `prefill` agent's finished prompts leave with their KV through
        `handover`'s slots (`exporting` until the step's reply), to a `decode` agent that takes them
        in (`incoming`) and never runs a prompt."""
        self.cfg, self.role = cfg, role
        self.spec = SpecPolicy(cfg) if speculate else None
        # the agent computes a step's padding (AgentInfo.pads_cost): else cutting a prompt to a bucket only delays its tail
        self.pads_cost = pads_cost
        # the prefix keys' root: what besides the tokens changes a block's KV
        salt = f"{cfg.model_name}|{cfg.model_path}|{cfg.model_cfg_path}|{cfg.model_dtype}|{cfg.kv_cache_dtype}"
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, salt)
        self.waiting: list[Sequence] = []  # oldest first, preempted ones in front
        self.running: list[Sequence] = []
        self.freed: list[int] = []  # ended since the last plan that was sent
        # totals, for metrics: preemptions, and KV tokens they threw away (to be computed again)
        self.preempted = self.discarded = 0
        self.moves = KvMoves(role, handover, self.blocks)  # sequences on their way out or in with their KV

    @property
    def active(self) -> int:
        """Sequences admitted here: running, and those whose KV is on its way out or in."""
        return len(self.running) + len(self.moves.exporting) + len(self.moves.incoming)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV its sequences hold here (planned steps included)."""
        return sum(seq.computed for seq in self.running + self.moves.exporting + self.moves.incoming)

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
        else:
            self.moves.remove(seq)
        self.blocks.release(seq.table)
        self.freed.append(seq.seq_id)

    def drain(self) -> list[Sequence]:
        """Take every sequence out (their agent died); their KV state is lost."""
        seqs = self.running + self.waiting + self.moves.drop_all()
        self.running, self.waiting = [], []
        for s in seqs:  # tokens in flight are lost with the agent
            s.table, s.computed, s.pending, s.agent_has_next = [], 0, 0, False
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        self.discarded, self.preempted = self.discarded + seq.computed, self.preempted + 1
        seq.computed, seq.preemptions = 0, seq.preemptions + 1
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
        """Seconds to hold an idle lane's first prefill for companions (step_plan.batch_hold); 0: now."""
        return batch_hold(self.cfg, self.running, self.waiting, now)

    def schedule(self) -> StepPlan:
        """The next step: decodes first, then chunks of started prompts, then new prompts."""
        if self.moves.draining:  # no rows: running sequences leave with their KV
            return self._plan([], moves=self.moves.plan_drain(self.running))
        preempted, discarded = self.preempted, self.discarded
        # Prefill runs faster per token in larger steps on AVX-512 (docs/perf-notes.md), but a larger
        # step delays every decode riding in it: the larger budget only while nothing decodes.
        decoding = any(seq.remaining == 1 for seq in self.running)
        step = StepBuilder(self.cfg, self.cfg.token_budget if decoding else self.cfg.prefill_budget)
        self._plan_decodes(step)
        if self.moves.incoming:  # handed over to this agent (server/sched/handover.py)
            self.moves.plan_imports(step, self.running, self.cfg.max_running)
        if self.role != Role.DECODE:
            self._plan_started(step)
            plan_admissions(step, self.waiting, self.running, self.blocks, self.cfg)
        drafting = (self.spec is not None and any(p.feed and p.sample for p in step.rows)
                    and self.spec.allows(len(self.running)))
        if drafting and not any(seq.scoring for seq in self.running):  # scored prompt tokens take the LM-head rows
            self.spec.plan_drafts(step, self.blocks, self.cfg)
        if self.pads_cost:
            end_at_bucket(step.rows, self.cfg.token_buckets)
        if self.role == Role.PREFILL:
            self.moves.plan_exports(step, self.running)
        commit(step.rows)
        return self._plan(step.rows, preempted=self.preempted - preempted, running=len(self.running),
                          drafting=drafting, discarded=self.discarded - discarded)

    def _plan(self, rows: list, **fields) -> StepPlan:
        """A plan; the sequences ended since the last one sent go with it when it sends anything."""
        sends = bool(rows or fields.get("moves"))
        plan = StepPlan(rows, self.freed if sends else [], **fields)
        if sends:
            self.freed = []
        return plan

    def handed(self, seq: Sequence) -> None:
        """`seq`'s KV is out (KvMoves.handed): the agent forgets it."""
        self.moves.handed(seq)
        self.freed.append(seq.seq_id)

    def evicted(self) -> list[Sequence]:
        """A decode agent's preempted sequences, a draining agent's waiting ones (KvMoves.evicted): to
        be computed again where prompts run; the agent forgets them."""
        self.waiting, out = self.moves.evicted(self.waiting)
        self.freed += [seq.seq_id for seq in out]
        return out

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

    def update(self, plan: StepPlan, results: list[RowResult]) -> None:
        """A step's reply (step_plan.record_reply)."""
        record_reply(plan, results, self.blocks, self.spec)
