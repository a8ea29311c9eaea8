"""KV hand-overs on the scheduler's side (prefill/decode disaggregation, drains): the slots of the
server's hand-over segment, each holding one KV block on its way from the agent that computed it
to the agent that goes on with it (the agents copy blocks into and out of them: agent/kv_handover.py,
docs/protocol.md), and how a scheduler plans sequences out and in (`KvMoves`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from server.step_plan import StepBuilder, StepPlan

if TYPE_CHECKING:
    from server.block_manager import BlockManager
    from server.sequence import Sequence


class HandoverSlots:
    def __init__(self, n: int):
        self.n = n
        self.free: list[int] = list(range(n - 1, -1, -1))  # low slots first: the pages in use stay few

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, k: int) -> list[int] | None:
        """`k` slots, or None (and none taken) when fewer are free."""
        if k > len(self.free):
            return None
        return [self.free.pop() for _ in range(k)]

    def give(self, slots: list[int]) -> None:
        self.free.extend(reversed(slots))
        slots.clear()


class KvMoves:
    """The scheduler's part in hand-overs (server.scheduler.Scheduler mixes it in): a prefill agent
    exports each prompt it ends, a draining one every sequence; an agent takes in its `incoming`."""
    role: str
    handover: HandoverSlots | None
    blocks: BlockManager
    running: list[Sequence]
    waiting: list[Sequence]
    exporting: list[Sequence]
    incoming: list[Sequence]
    freed: list[int]
    max_running: int
    draining: bool
    moved: int

    def _plan_imports(self, step: StepBuilder) -> None:
        """Sequences handed over, in order, while blocks and running room last (an import never
        preempts): their blocks come in with the step, and their next row rides in it (a decode, or
        a prompt's next chunk; on a prefill agent one that does not end the prompt: that one exports)."""
        for seq in list(self.incoming):
            decode = seq.remaining == 1
            n = 1 if decode else min(step.chunk(seq), seq.remaining - (self.role == "prefill")) if step.open else 0
            if n <= 0 or len(self.running) >= self.max_running or not self.blocks.grow(seq.table, seq.computed + n):
                break
            self.incoming.remove(seq)
            self.running.append(seq)
            step.add_decode(seq) if decode else step.add_chunk(seq, n)
            step.rows[-1].admitted = step.rows[-1].imported = True

    def _plan_drain(self) -> StepPlan:
        """Draining: no rows; every running sequence with nothing in flight leaves with its KV, as
        many as the hand-over slots hold (the step only exports)."""
        moves = []
        for seq in [s for s in self.running if not s.pending]:
            slots = self.handover.take(self.blocks.blocks_needed([], seq.computed))
            if slots is None:
                break
            seq.handover = slots
            self.running.remove(seq)
            self.exporting.append(seq)
            moves.append(seq)
        plan = StepPlan([], self.freed if moves else [], moves=moves)
        if moves:
            self.freed = []
        return plan

    def _plan_exports(self, step: StepBuilder) -> None:
        """Prefill role: a row that ends its prompt (it samples the first token) exports the prompt's
        blocks into hand-over slots after the step; with too few slots free it stops one token short
        (no sample) and ends in a later step."""
        for p in [p for p in step.rows if p.sample and not p.feed]:
            slots = self.handover.take(self.blocks.blocks_needed([], p.seq.computed + p.n_tokens))
            if slots is not None:
                p.seq.handover, p.export = slots, True
                self.running.remove(p.seq)
                self.exporting.append(p.seq)
            elif p.n_tokens > 1:
                p.n_tokens, p.sample = p.n_tokens - 1, False
            else:
                step.drop(p.seq)

    def handed(self, seq: Sequence) -> None:
        """`seq`'s KV is in its hand-over slots (a prefill agent's prompt, a drain); its blocks here are
        released (still cached for prefix reuse) and the agent forgets it."""
        self.exporting.remove(seq)
        self.moved += 1
        self.blocks.release(seq.table)
        self.freed.append(seq.seq_id)

    def evicted(self) -> list[Sequence]:
        """A decode agent's preempted sequences, a draining agent's waiting ones (none with a token in
        flight): to be computed again where prompts run; the agent forgets them."""
        if self.role != "decode" and not self.draining:
            return []
        out = [seq for seq in self.waiting if not seq.pending]
        self.waiting = [seq for seq in self.waiting if seq.pending]
        self.freed += [seq.seq_id for seq in out]
        return out
