"""What the agent remembers of each sequence between steps: its last sample (the input of a fed
`a` row), its token history (for penalties), its grammar's matcher (agent/grammar.py) and its
precision-file name (--dump-logits)."""
from __future__ import annotations

from typing import Any

import numpy as np

from agent.grammar import Grammars
from agent.logits_dump import LogitsDump
from agent.sampling import needs_penalty
from shm.step import SamplingColumns, StepInputs


class SequenceState:
    def __init__(self) -> None:
        self.histories: dict[int, list[int]] = {}  # token history of rows that use penalties
        self.last: dict[int, int] = {}  # each sequence's last sampled token: what a fed row takes as input
        self.dump = LogitsDump.from_env()  # the contest's raw-logit precision files (--dump-logits)
        self.grammars: Grammars | None = None  # set by the agent's boot where the tokenizer is at hand

    def free(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.histories.pop(seq, None)
            self.last.pop(seq, None)
            if self.grammars is not None:
                self.grammars.free(seq)
            if self.dump is not None:
                self.dump.forget(seq)

    def reset(self) -> None:
        self.histories.clear()
        self.last.clear()
        if self.grammars is not None:
            self.grammars.matchers.clear()

    def start_grammars(self, grammars: list[list[Any]]) -> None:
        """[seq, grammar, outputs so far] of the constrained sequences a step (re)admits."""
        if grammars and self.grammars is None:
            raise ValueError("this agent has no grammar engine (llguidance) for constrained rows")
        for seq, grammar, outputs in grammars:
            self.grammars.start(seq, grammar, outputs)

    def feed(self, x: StepInputs, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's tokens with every fed row's token replaced by its sequence's last sample here,
        and which rows had none (a sequence this agent never sampled, or whose sampling failed)."""
        tokens = x.tokens
        unfed = np.zeros(x.feed.shape[0], bool)
        rows = np.nonzero(x.feed)[0]
        if rows.size:
            tokens = tokens.copy()  # the arena's inputs stay as the server wrote them
            last = np.array([self.last.get(int(s), -1) for s in x.seq_ids[rows]], np.int32)
            unfed[rows] = last < 0
            tokens[starts[rows]] = np.maximum(last, 0)
        return tokens, unfed

    def sampled(self, seq_ids: np.ndarray, ids: np.ndarray) -> None:
        self.last.update(zip(seq_ids.tolist(), ids.tolist()))

    def track(self, x: StepInputs, tokens: np.ndarray, cols: SamplingColumns, starts: np.ndarray) -> None:
        """Penalties need every token a sequence has fed; a chunk starting at position 0 restarts it."""
        for r in np.nonzero(needs_penalty(cols))[0]:
            s, q = starts[r], x.query_lens[r]
            seq = int(x.seq_ids[r])
            if x.positions[s] == 0:
                self.histories[seq] = []
            self.histories.setdefault(seq, []).extend(tokens[s:s + q].tolist())

    def history(self, seq: int) -> np.ndarray | None:
        h = self.histories.get(seq)
        return None if h is None else np.asarray(h, np.int64)

    def write_dump(self, x: StepInputs, tokens: np.ndarray, starts: np.ndarray, logits: np.ndarray,
                   rows: Any) -> None:
        """The contest's precision files (agent.logits_dump): names from prompts' first chunks."""
        assert self.dump is not None
        for r in np.nonzero(x.positions[starts] == 0)[0]:
            self.dump.started(int(x.seq_ids[r]), tokens[starts[r]:starts[r] + x.query_lens[r]].tolist())
        last = (starts + x.query_lens - 1)[rows]
        if logits.shape[0]:
            self.dump.write(logits, x.seq_ids[rows], x.positions[last])
