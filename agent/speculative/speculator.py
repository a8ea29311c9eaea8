"""A step with drafts: the proposer fills each drafting row's draft slots, the target model runs the
step once, and verification keeps each row's drafts while they equal what plain decoding samples
(verify.py). The runner hands such a step here whole; with speculation off it never comes."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agent.runner_config import logit_positions, row_starts
from agent.sampling import write_samples
from agent.sequences import SequenceState
from agent.speculative.proposer import Proposer
from agent.speculative.verify import heads, verify, without_unfilled, write_drafts
from shm.step import StepInputs, StepOutputs, StepView

if TYPE_CHECKING:
    from agent.runner import ModelRunner


class Speculator:
    def __init__(self, proposer: Proposer, seqs: SequenceState):
        self.proposer, self.seqs = proposer, seqs
        self.method = proposer.method

    def step(self, runner: "ModelRunner", v: StepView, x: StepInputs, tokens: np.ndarray, starts: np.ndarray,
             unfed: np.ndarray) -> float:
        """Drafts in (their empty slots out), one forward, the verification; returns model seconds."""
        drafted, first = self._draft(x, tokens, starts, unfed), np.cumsum(x.spec_len) - x.spec_len
        x, tokens = without_unfilled(x, tokens, starts, drafted)
        starts = row_starts(x.query_lens, x.tokens.shape[0])
        logits, lse, elapsed = runner.logits(v, x, tokens, starts)
        rows = np.nonzero(x.sample)[0]
        spec = x.spec_len[rows]
        head = heads(logit_positions(x, starts), x.tokens.shape[0], (starts + x.query_lens - 1)[rows], spec)
        width = int(spec.max(initial=0))
        slot = starts[rows, None] + 1 + np.arange(width)[None, :]
        drafts = np.where(np.arange(width)[None, :] < spec[:, None], tokens[np.minimum(slot, tokens.size - 1)], -1)
        n_top = int(v.sampling.n_logprobs[rows].max(initial=0))

        def sample_pass(lg: np.ndarray, ls: np.ndarray, at: np.ndarray, j: int) -> StepOutputs:
            return self.seqs.sample(v, lg, ls, at, unfed if j == 0 else np.zeros_like(unfed), offset=j)

        def kept_fn(at: np.ndarray, ids: np.ndarray) -> None:
            for r, t in zip(at.tolist(), ids.tolist()):
                self.seqs.accept(int(x.seq_ids[r]), [t])

        final, accepted, kept = verify(sample_pass, kept_fn, logits, lse, rows, head, drafts, spec, n_top)
        if runner.writes:
            write_samples(v.outputs, rows, final)
            v.outputs.drafted[:], v.outputs.accepted[:] = x.spec_len, 0
            v.outputs.accepted[rows] = accepted
            write_drafts(v.drafts, first[rows], accepted, kept)
        return elapsed

    def _draft(self, x: StepInputs, tokens: np.ndarray, starts: np.ndarray, unfed: np.ndarray) -> np.ndarray:
        """Fill each drafting row's draft slots in `tokens` (after `track` took its fed token) with its
        proposer's drafts; returns how many each row got (the rest stay placeholders, never accepted)."""
        drafted = np.zeros(x.spec_len.shape[0], np.int32)
        hist = self.seqs.histories
        rows = [int(r) for r in np.nonzero(x.spec_len)[0] if not unfed[r] and int(x.seq_ids[r]) in hist]
        logs = [hist[int(x.seq_ids[r])].view() for r in rows]
        for r, d in zip(rows, self.proposer.propose_step(x, starts, rows, logs)):
            tokens[starts[r] + 1:starts[r] + 1 + d.size] = d
            drafted[r] = d.size
        return drafted
