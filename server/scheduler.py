"""Token-budget continuous-batching scheduler for one agent (one KV cache).

Each step: decodes first, then running chunked prefills, then new prompts, within a token budget
(Dynamic SplitFuse: long prompts are split into chunks, short ones fused into one step). When KV
blocks run out, the most recently admitted sequence is preempted and later recomputed.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from server.block_manager import BlockManager
from server.config import ServingConfig
from server.sampling_params import SamplingParams

_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    arrival: float
    request: Any = None  # the engine's request record
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of full blocks, grown as computed
    preemptions: int = 0
    aborted: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        return len(self.prompt) + len(self.output) - self.computed


@dataclass
class Planned:
    seq: Sequence
    n_tokens: int
    sample: bool


class Scheduler:
    def __init__(self, cfg: ServingConfig):
        self.cfg = cfg
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.max_running = cfg.decode_buckets[-1]
        self.max_chunk = cfg.prefill_buckets[-1]
        self.preempted = 0  # total preemptions, for metrics

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
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)

    def drain(self) -> list[Sequence]:
        """Take every sequence out (their agent died); their KV state is lost."""
        seqs = self.running + self.waiting
        self.running, self.waiting = [], []
        for s in seqs:
            s.table, s.computed = [], 0
        return seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.computed = 0
        seq.preemptions += 1
        self.preempted += 1
        self.waiting.insert(0, seq)

    def schedule(self) -> list[Planned]:
        plan: list[Planned] = []
        budget = self.cfg.token_budget
        prefill_rows = 0
        for seq in list(self.running):  # 1. decodes, oldest first; preempt the newest on shortage
            if seq not in self.running or seq.remaining != 1:
                continue
            while not self.blocks.grow(seq.table, seq.computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                plan = [p for p in plan if p.seq is not victim]
                if victim is seq:
                    break
            if seq in self.running:
                plan.append(Planned(seq, 1, True))
                budget -= 1
        for seq in self.running:  # 2. chunks of prompts already started
            if seq.remaining > 1 and budget > 0 and prefill_rows < self.cfg.max_prefill_rows:
                n = min(seq.remaining, budget, self.max_chunk)
                if not self.blocks.grow(seq.table, seq.computed + n):
                    break
                plan.append(Planned(seq, n, n == seq.remaining))
                budget -= n
                prefill_rows += 1
        self.waiting.sort(key=self._order_key)
        while (self.waiting and budget > 0 and prefill_rows < self.cfg.max_prefill_rows
               and len(self.running) < self.max_running):  # 3. admit new prompts
            seq = self.waiting[0]
            if not seq.table:
                seq.table = self.blocks.match_prefix(seq.tokens)
                seq.computed = len(seq.table) * self.cfg.block_size
            n = min(seq.remaining, budget, self.max_chunk)
            if not self.blocks.grow(seq.table, seq.computed + n):
                self.blocks.release(seq.table)
                seq.computed = 0
                break
            self.waiting.pop(0)
            self.running.append(seq)
            plan.append(Planned(seq, n, n == seq.remaining))
            budget -= n
            prefill_rows += 1
        return plan

    def step_done(self, plan: list[Planned]) -> None:
        for p in plan:
            p.seq.computed += p.n_tokens
            self.blocks.register_full(p.seq.table, p.seq.tokens, p.seq.computed, p.seq.block_hashes)
