"""Prompt lookup (vLLM's `ngram` method): the longest suffix of a sequence (`max_n` down to `min_n`
tokens) that occurred earlier in its prompt or output proposes the tokens that followed it there."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from agent.runner_config import RunnerConfig
from common.config import ServingConfig
from shm.step import StepInputs


def from_config(cfg: ServingConfig, rc: RunnerConfig, vocab_size: int, tokenizer: Any) -> "NgramProposer":
    """The `ngram` row's proposer (common/speculative.py)."""
    return NgramProposer(cfg.spec_lookup_min, cfg.spec_lookup_max, cfg.spec_method)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, method: str = ""):
        """`method`: its registry row's name (common/speculative.py), which the agent reports at attach."""
        self.method = method
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min {min_n} and prompt_lookup_max {max_n}: need 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n

    def propose_step(self, x: StepInputs, starts: np.ndarray, rows: list[int],
                     histories: list[np.ndarray]) -> list[np.ndarray]:
        """Drafts for step rows `rows` (each with x.spec_len[r] slots) from their histories."""
        return [self.propose(h, int(x.spec_len[r])) for r, h in zip(rows, histories)]

    def forget(self, seqs: Iterable[int]) -> None:  # nothing is kept between steps
        pass

    def reset(self) -> None:
        pass

    def graph_compiles(self) -> int:
        return 0

    def warmup(self) -> None:
        pass

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to `k` drafts to follow `tokens` (the sequence so far, its last sample included)."""
        size = tokens.size
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = tokens[size - n:]
            starts = np.flatnonzero(tokens[:size - n] == tail[0])  # each leaves a token after its n-gram
            for t in range(1, n):
                if not starts.size:
                    break
                starts = starts[tokens[starts + t] == tail[t]]
            if starts.size:
                # The latest occurrence that k tokens follow (else the latest): a copy goes on from there.
                full = starts[starts + n + k <= size]
                at = int(full[-1] if full.size else starts[-1]) + n
                return tokens[at:at + k].copy()
        return tokens[:0].copy()
