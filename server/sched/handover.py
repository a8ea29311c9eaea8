"""KV hand-overs on the scheduler's side (prefill/decode disaggregation, drains): the slots of the
server's hand-over segment, each holding one KV block on its way from the agent that computed it
to the agent that goes on with it (the agents copy blocks into and out of them: agent/handover.py,
docs/protocol.md), and a scheduler's sequences planned out and in (`KvMoves`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.config_values import Role
from server.sched.step_plan import StepBuilder

if TYPE_CHECKING:
    from server.sched.block_manager import BlockManager
    from server.sched.sequence import Sequence


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
    """A scheduler's sequences on their way out or in with their KV (hand-overs): a prefill agent
    exports each prompt it ends, a draining one every sequence, and an agent takes in its `incoming`.
    The scheduler hands it the lists it plans from; it keeps its own."""

    def __init__(self, role: str, handover: HandoverSlots | None, blocks: BlockManager):
        self.role, self.handover, self.blocks = role, handover, blocks
        self.exporting: list[Sequence] = []  # their KV on its way out (a prefill agent's prompts, a drain)
        self.incoming: list[Sequence] = []  # handed to this agent, their KV in the hand-over slots
        self.draining = False  # every sequence leaves with its KV; nothing new comes (POST /admin/agents/{port}/drain)
        self.moved = 0  # sequences that left with their KV

    def plan_imports(self, step: StepBuilder, running: list[Sequence], max_running: int) -> None:
        """Sequences handed over, in order, while blocks and running room last (an import never
        preempts): their blocks come in with the step, and their next row rides in it (a decode, or
        a prompt's next chunk; on a prefill agent one that does not end the prompt: that one exports)."""
        for seq in list(self.incoming):
            decode = seq.remaining == 1
            n = 1 if decode else min(step.chunk(seq), seq.remaining - (self.role == Role.PREFILL)) if step.open else 0
            if n <= 0 or len(running) >= max_running or not self.blocks.grow(seq.table, seq.computed + n):
                break
            self.incoming.remove(seq)
            running.append(seq)
            step.add_decode(seq) if decode else step.add_chunk(seq, n)
            step.rows[-1].admitted = step.rows[-1].imported = True

    def plan_drain(self, running: list[Sequence]) -> list[Sequence]:
        """Draining: every running sequence with nothing in flight leaves with its KV, as many as the
        hand-over slots hold (taken out of `running`); the step that carries them only exports."""
        moves = []
        for seq in [s for s in running if not s.pending]:
            slots = self.handover.take(self.blocks.blocks_needed([], seq.computed))
            if slots is None:
                break
            seq.handover = slots
            running.remove(seq)
            self.exporting.append(seq)
            moves.append(seq)
        return moves

    def plan_exports(self, step: StepBuilder, running: list[Sequence]) -> None:
        """Prefill role: a row that ends its prompt (it samples the first token) exports the prompt's
        blocks into hand-over slots after the step; with too few slots free it stops one token short
        (no sample) and ends in a later step."""
        for p in [p for p in step.rows if p.sample and not p.feed]:
            slots = self.handover.take(self.blocks.blocks_needed([], p.seq.computed + p.n_tokens))
            if slots is not None:
                p.seq.handover, p.export = slots, True
                running.remove(p.seq)
                self.exporting.append(p.seq)
            elif p.n_tokens > 1:
                p.n_tokens, p.sample = p.n_tokens - 1, False
            else:
                step.drop(p.seq)

    def handed(self, seq: Sequence) -> None:
        """`seq`'s KV is in its hand-over slots (a prefill agent's prompt, a drain); its blocks here are
        released (still cached for prefix reuse)."""
        self.exporting.remove(seq)
        self.moved += 1
        self.blocks.release(seq.table)

    def evicted(self, waiting: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(`waiting` kept, taken out): a decode agent's preempted sequences, a draining agent's waiting
        ones, none with a token in flight, leave to be computed again where prompts run."""
        if self.role != Role.DECODE and not self.draining:
            return waiting, []
        return [seq for seq in waiting if seq.pending], [seq for seq in waiting if not seq.pending]

    def remove(self, seq: Sequence) -> bool:
        """Drop an ended sequence if it is on its way in (its slots given back) or out (given back at
        its step's reply: the agent writes them); False if it is neither."""
        if seq in self.incoming:
            self.incoming.remove(seq)
            self.handover.give(seq.handover)
        elif seq in self.exporting:
            self.exporting.remove(seq)
        else:
            return False
        return True

    def drop_all(self) -> list[Sequence]:
        """The agent is gone: nobody reads or writes the moving sequences' slots; they are returned."""
        seqs = self.exporting + self.incoming
        for s in seqs:
            self.handover.give(s.handover)
        self.exporting, self.incoming = [], []
        return seqs
