"""What the agent remembers of each sequence between steps: its last sample (the input of a fed
`a` row), its token history (for penalties, and for every sequence where the agent drafts: its
proposer reads it), its grammar's matcher (agent/grammar.py) and its precision-file name
(--dump-logits)."""
from __future__ import annotations

from typing import Any

import numpy as np

from agent.grammar import Grammars
from agent.logits_dump import LogitsDump
from agent.sampling import needs_penalty, sample
from agent.speculative.proposer import Proposer
from shm.step import SamplingColumns, StepInputs, StepOutputs, StepView


class TokenLog:
    """A sequence's fed tokens in a growing int32 buffer: appends amortised, reads are views."""
    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf, self.n = np.empty(64, np.int32), 0

    def extend(self, tokens: np.ndarray | list[int]) -> None:
        end = self.n + len(tokens)
        if end > self.buf.size:
            self.buf = np.concatenate([self.buf[:self.n], np.empty(max(end, 2 * self.buf.size) - self.n, np.int32)])
        self.buf[self.n:end] = tokens
        self.n = end

    def view(self) -> np.ndarray:
        return self.buf[:self.n]


class SequenceState:
    def __init__(self, seed: int = 0, proposer: Proposer | None = None) -> None:
        """`proposer`: drafts tokens for rows with `spec` (agent/speculative/); then every sequence's history is kept."""
        self.histories: dict[int, TokenLog] = {}  # fed tokens of rows that use penalties (all, with a proposer)
        self.last: dict[int, int] = {}  # each sequence's last sampled token: what a fed row takes as input
        self.dump = LogitsDump.from_env()  # the contest's raw-logit precision files (--dump-logits)
        self.grammars: Grammars | None = None  # set by the agent's boot where the tokenizer is at hand
        self.proposer = proposer
        self.rng = np.random.default_rng(seed)  # sampling's: one seed per replica (every rank samples alike)

    def free(self, seqs: list[int]) -> None:
        if self.proposer is not None:
            self.proposer.forget(seqs)
        for seq in seqs:
            self.histories.pop(seq, None)
            self.last.pop(seq, None)
            if self.grammars is not None and self.grammars.matchers:
                self.grammars.free(seq)
            if self.dump is not None:
                self.dump.forget(seq)

    def reset(self) -> None:
        self.histories.clear()
        self.last.clear()
        if self.proposer is not None:
            self.proposer.reset()
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
        """Penalties and proposers need every token a sequence has fed (a row's drafts join once
        accepted: `accept`); a chunk starting at position 0 restarts it."""
        rows = range(x.query_lens.shape[0]) if self.proposer is not None else np.nonzero(needs_penalty(cols))[0]
        for r in rows:
            s, q = starts[r], x.query_lens[r] - x.spec_len[r]
            seq = int(x.seq_ids[r])
            if x.positions[s] == 0 or seq not in self.histories:
                self._restart(seq)
            self.histories[seq].extend(tokens[s:s + q])

    def start_histories(self, histories: list[list[Any]]) -> None:
        """[seq, tokens] of the sequences a step admits past position 0 (a prefix-cache hit, a KV
        hand-over) whose sampling reads their tokens: those before the row, never fed here."""
        for seq, tokens in histories:
            self._restart(seq).extend(tokens)

    def _restart(self, seq: int) -> TokenLog:
        """A new history (a prompt from position 0, a re-admission, a hand-over): what a proposer
        computed of the old one is forgotten."""
        if self.proposer is not None:
            self.proposer.forget([seq])
        log = self.histories[seq] = TokenLog()
        return log

    def forget_last(self, seq: int) -> None:
        """Its KV came from another agent: no last sample here (its next row carries its token)."""
        self.last.pop(seq, None)

    def accept(self, seq: int, drafts: np.ndarray) -> None:
        """Drafts verified and kept: fed tokens now (their K/V stay in the cache)."""
        if seq in self.histories:
            self.histories[seq].extend(drafts)

    def sample(self, v: StepView, logits: np.ndarray, lse: np.ndarray, rows: slice | np.ndarray,
               unfed: np.ndarray, offset: int = 0) -> StepOutputs:
        """The sampled rows' tokens under their grammars' masks; a row whose input was unknown or whose
        grammar is in error gets -1 (it fails, its neighbours go on). `offset`: the position within
        rows being verified (their output so far is that many tokens longer)."""
        seq_ids = v.inputs.seq_ids[rows]
        hist = [self.history(int(s)) for s in seq_ids]
        g = self.grammars
        constrained = g.constrained(seq_ids) if g is not None and g.matchers else []  # none: no grammar code
        failed = g.mask(logits, constrained) if constrained else None
        cols = v.sampling.take(rows)
        if offset:
            cols.output_len = cols.output_len + offset
        res = sample(logits, lse, cols, hist, self.rng)
        res.ids[unfed[rows]] = -1
        if constrained:
            res.ids[failed] = -1
            g.consume(constrained, res.ids)
        self.sampled(seq_ids, res.ids)
        return res

    def history(self, seq: int) -> np.ndarray | None:
        h = self.histories.get(seq)
        return None if h is None else h.view()

    def write_dump(self, x: StepInputs, tokens: np.ndarray, starts: np.ndarray, logits: np.ndarray,
                   rows: Any) -> None:
        """The contest's precision files (agent.logits_dump): names from prompts' first chunks."""
        assert self.dump is not None
        for r in np.nonzero(x.positions[starts] == 0)[0]:
            self.dump.started(int(x.seq_ids[r]), tokens[starts[r]:starts[r] + x.query_lens[r]].tolist())
        last = (starts + x.query_lens - 1)[rows]
        if logits.shape[0]:
            self.dump.write(logits, x.seq_ids[rows], x.positions[last])
