"""How many drafts each decode asks its agent for (speculative_config): per sequence, adapted to what
its last verifications kept; and per step, whether drafts pay at all at this batch size on this
agent.

Whether they pay depends on the CPU: drafts are extra query tokens, nearly free while a step is
bound by reading the weights (small batches) and a token's compute each once it is bound by
compute, which happens at a batch of a few on a 2-core AVX2 machine and far later with AMX; and a
drafting sequence skips the overlap (its next step waits for its reply). So the policy measures
instead of guessing: per batch-size class (running sequences, powers of two) it runs TRIAL decode
steps with drafts and TRIAL without, counting the tokens emitted over wall time, then RUN steps in
the better mode, and measures again. None at all past `disable_by_batch_size`.

A sequence whose drafts held asks for one more than it kept (up to num_speculative_tokens); one
whose drafts were all rejected asks for none for 1, 2, 4 ... 16 decodes before it tries again, so
text that does not repeat itself soon stops costing draft tokens. Slots the proposer leaves empty
(no match) cost nothing (the agent drops them), only the overlap: such a sequence takes one plain
decode before it asks again. The agent proposes and verifies (agent/speculative/)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.config import ServingConfig

if TYPE_CHECKING:
    from server.sched.block_manager import BlockManager
    from server.sched.step_plan import StepBuilder

MAX_SKIP = 16
TRIAL, RUN = 8, 64  # decode steps of a batch-size class measured in each mode, then run in the better one
NEXT = {"on": "off", "off": "run", "run": "on"}


@dataclass(slots=True)
class SpecState:
    """A sequence's drafting state."""
    k: int  # drafts its next decode asks for
    skip: int = 0  # decodes left without drafts
    misses: int = 0  # verifications in a row that kept nothing


@dataclass(slots=True)
class Trial:
    """A batch-size class's measurement: which mode runs now, for how many more steps, and the
    tokens and seconds each mode's steps have shown in this round."""
    phase: str = "on"  # on, off (the two trials), then run (the better mode)
    left: int = TRIAL
    best: bool = True
    seen: dict = field(default_factory=lambda: {True: [0, 0.0], False: [0, 0.0]})


class SpecPolicy:
    def __init__(self, cfg: ServingConfig):
        self.k_max, self.max_batch = cfg.spec_tokens, cfg.spec_max_batch
        self.trials: dict[int, Trial] = {}  # per batch-size class (running.bit_length())

    def allows(self, running: int) -> bool:
        """Drafts in the next step while this many sequences run: TRIAL steps with them, TRIAL
        without, then RUN steps in the mode that emitted more tokens per second, and again."""
        if self.max_batch and running > self.max_batch:
            return False
        t = self.trials.setdefault(running.bit_length(), Trial())
        if t.left == 0:
            t.phase, t.left = NEXT[t.phase], RUN if t.phase == "off" else TRIAL
            if t.phase == "run":
                on, off = (tokens / seconds if seconds else 0.0 for tokens, seconds in (t.seen[True], t.seen[False]))
                t.best = on >= off
            elif t.phase == "on":
                t.seen = {True: [0, 0.0], False: [0, 0.0]}
        t.left -= 1
        return t.best if t.phase == "run" else t.phase == "on"

    def observe_step(self, running: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A decode step planned while `running` sequences ran, in the mode `drafting`, emitted `tokens`
        in `seconds` of wall time (from the previous reply, or from its planning if later)."""
        t = self.trials.get(running.bit_length())
        if t is not None and t.phase != "run":
            t.seen[drafting][0] += tokens
            t.seen[drafting][1] += seconds

    def wanted(self, state: SpecState | None) -> tuple[int, SpecState]:
        """Drafts the sequence's next decode asks for, and its state (made at its first decode)."""
        state = state or SpecState(self.k_max)
        if state.skip:
            state.skip -= 1
            return 0, state
        return state.k, state

    def observe(self, state: SpecState, drafted: int, accepted: int) -> None:
        """A verification kept `accepted` of the `drafted` drafts the agent proposed."""
        if accepted:
            state.k, state.misses = min(self.k_max, accepted + 1), 0
        elif drafted:  # all rejected: they cost their compute
            state.misses += 1
            state.k, state.skip = 1, min(MAX_SKIP, 2 ** (state.misses - 1))
        else:  # none proposed (no compute spent on them): one plain decode, which may overlap
            state.skip = 1

    def plan_drafts(self, step: StepBuilder, blocks: BlockManager, cfg: ServingConfig) -> None:
        """Drafts on the step's fed decodes, oldest first, within the step's token budget, the
        graph's LM-head rows (every draft is scored), each sequence's length limits and the free
        blocks (a draft never preempts anyone). Nothing is planned for a drafting sequence until its
        reply says how many drafts held (its `remaining` is below 1 meanwhile)."""
        room = min(step.tokens, cfg.max_running - len(step.rows))
        for p in [p for p in step.rows if p.feed and p.sample]:
            seq = p.seq
            want, seq.spec = self.wanted(seq.spec)
            n_out = len(seq.output) + seq.pending
            free = (len(seq.table) + blocks.num_free) * cfg.block_size - seq.computed - 1
            k = min(want, room, free, seq.params.max_new_tokens - n_out - 1, cfg.max_total_tokens - seq.computed - 2)
            if k > 0 and blocks.grow(seq.table, seq.computed + 1 + k):
                step.add_drafts(p, k)
                room -= k
