"""A step's plan as the scheduler builds it: its rows (`Planned`), the step (`StepPlan`), the
builder that holds its token budget while the scheduler fills it (`StepBuilder`), and what its
reply changes (`record_reply`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.config import ServingConfig

if TYPE_CHECKING:  # server.sched.scheduler imports this module
    from server.sched.block_manager import BlockManager
    from server.sched.sequence import Sequence
    from server.sched.speculative import SpecPolicy

# A step pads to its token bucket, and padding costs as much as tokens, while a step's fixed cost is
# worth a few dozen tokens (docs/perf-notes.md). So a step just past a bucket gives its last chunk's
# overflow to the next step, when that saves at least this much padding.
MIN_TRIMMED_PADDING = 64


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
    spec: int = 0  # draft tokens the agent proposes after its fed one (n_tokens is 1 + spec)
    export: bool = False  # it ends its prompt on a prefill agent: its KV leaves through its hand-over slots
    imported: bool = False  # its KV comes in from its hand-over slots before the step (a decode agent)


@dataclass
class RowResult:
    """What a planned row gave back: the tokens to append (its accepted drafts, then its sample; none
    for a row that does not sample, failed, or whose request ended meanwhile), how many drafts the
    agent proposed for it and how many of them it kept in the cache (whatever became of the request)."""
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0


@dataclass
class StepPlan:
    """One step: its rows, the sequences ended since the last step (the agent drops their state),
    and how many sequences planning it preempted."""
    rows: list[Planned]
    freed: list[int] = field(default_factory=list)
    preempted: int = 0
    running: int = 0  # sequences running when it was planned (speculation's batch-size class)
    drafting: bool = False  # planned in speculation's drafting mode (server/sched/speculative.py)
    moves: list[Sequence] = field(default_factory=list)  # leave with their KV after it (a drain): exports without rows
    discarded: int = 0  # KV tokens planning it threw away (preemption)

    def __bool__(self) -> bool:
        return bool(self.rows or self.moves)

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
    alone: 128 + 13 tokens in two steps instead of 141 padded to 256."""
    total = sum(p.n_tokens for p in plan)
    above = next((b for b in buckets if b >= total), total)
    below = max((b for b in buckets if b < total), default=0)
    cut, padding = total - below, above - total
    last = plan[-1] if plan else None
    if last and not last.spec and below and cut < last.n_tokens and cut < padding and padding >= MIN_TRIMMED_PADDING:
        last.n_tokens -= cut  # its blocks stay reserved for the next step
        last.sample = False


class StepBuilder:
    """One step as it is built: its rows, the tokens its budget has left and its prefill rows."""

    def __init__(self, cfg: ServingConfig, tokens: int):
        self.cfg, self.tokens, self.prefill_rows = cfg, tokens, 0
        self.rows: list[Planned] = []

    @property
    def open(self) -> bool:
        """Room for another prefill chunk."""
        return self.tokens > 0 and self.prefill_rows < self.cfg.max_prefill_rows

    def chunk(self, seq: Sequence) -> int:
        """How many of `seq`'s prompt tokens this step takes: what the budget leaves, and for a scored
        prompt (prompt logprobs) what the step's LM-head rows leave (score_room)."""
        room = score_room(self.rows, self.cfg) if seq.scoring else self.tokens
        return min(seq.remaining, self.tokens, room)

    def add_decode(self, seq: Sequence) -> None:
        self.rows.append(Planned(seq, 1, True, feed=seq.agent_has_next))
        self.tokens -= 1

    def add_chunk(self, seq: Sequence, n: int, admitted: bool = False) -> None:
        self.rows.append(Planned(seq, n, n == seq.remaining, admitted=admitted))
        self.tokens = 0 if seq.scoring else self.tokens - n  # nothing is planned after a scored chunk
        self.prefill_rows += 1

    def add_drafts(self, p: Planned, k: int) -> None:
        """`k` drafts on decode row `p`: query tokens of the step like any other."""
        p.spec, p.n_tokens = k, 1 + k
        self.tokens -= k

    def drop(self, seq: Sequence) -> None:
        """`seq` was preempted: its rows leave the step."""
        self.rows[:] = [p for p in self.rows if p.seq is not seq]


def commit(rows: list[Planned]) -> None:
    """The plan is final: its rows count as computed, its samples as pending (the overlap: the next
    step is planned before this one's reply)."""
    for p in rows:
        seq = p.seq
        p.start, p.output_len, p.epoch = seq.computed, len(seq.output) + seq.pending, seq.preemptions
        p.targets = seq.targets(p.start, p.n_tokens)
        seq.computed += p.n_tokens
        seq.pending += p.sample
        seq.agent_has_next = p.sample


def record_reply(plan: StepPlan, results: list[RowResult], blocks: BlockManager, spec: SpecPolicy | None) -> None:
    """A step's reply: its samples are no longer pending, a drafting row's rejected drafts leave
    the cache (`computed`), each row's tokens are appended, and the full blocks it computed are
    published for prefix reuse."""
    for p, res in zip(plan.rows, results, strict=True):
        seq = p.seq
        seq.pending -= p.sample
        rejected = p.spec - res.accepted
        if p.spec and p.epoch == seq.preemptions:
            seq.computed -= rejected  # their K/V are overwritten by the next tokens there
            if spec is not None and seq.spec is not None:
                spec.observe(seq.spec, res.drafted, res.accepted)
        seq.output.extend(res.tokens)
        if p.epoch == seq.preemptions and seq.table:
            blocks.register_full(seq.table, seq.tokens, p.start + p.n_tokens - rejected, seq.block_hashes,
                                 seq.params.adapter_key)


def order_key(seq: Sequence, policy: str) -> tuple:
    """Waiting sequences' order: preempted ones first, then by the policy."""
    if policy == "sjf":  # shortest max_new_tokens first (contest write-ups)
        return (-seq.preemptions, seq.params.max_new_tokens, seq.arrival)
    if policy == "priority":
        return (-seq.preemptions, seq.params.priority, seq.arrival)
    return (-seq.preemptions, seq.arrival)


def plan_admissions(step: StepBuilder, waiting: list[Sequence], running: list[Sequence], blocks: BlockManager,
                    cfg: ServingConfig) -> None:
    """New prompts, in policy order, while blocks last. A preempted sequence whose sampled token is
    still in flight waits for it: recomputing without it would sample that token a second time."""
    waiting.sort(key=lambda seq: order_key(seq, cfg.schedule_policy))
    for seq in [seq for seq in waiting if not seq.pending]:
        if not step.open or len(running) >= cfg.max_running:
            break
        if not seq.table and not seq.scoring:
            seq.table = blocks.match_prefix(seq.tokens, seq.params.adapter_key)
            seq.computed = len(seq.table) * cfg.block_size
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.computed
        n = step.chunk(seq)
        if n <= 0 or not blocks.grow(seq.table, seq.computed + n):
            blocks.release(seq.table)
            seq.computed = 0
            break
        waiting.remove(seq)
        running.append(seq)
        step.add_chunk(seq, n, admitted=True)


def batch_hold(cfg: ServingConfig, running: list[Sequence], waiting: list[Sequence], now: float) -> float:
    """Seconds to hold the first prefill of an idle lane for companions (the original's
    `prefill_batch_waiting_time`): only while nothing runs and fewer than prefill_batch_size
    prompts wait, and never past the window from the oldest arrival. 0: schedule now."""
    window = cfg.prefill_batch_waiting_time
    if window <= 0 or running or not waiting or len(waiting) >= cfg.max_prefill_rows:
        return 0.0
    return max(0.0, min(s.arrival for s in waiting) + window - now)
