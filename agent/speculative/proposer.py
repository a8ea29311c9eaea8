"""What the runner asks of a proposer (agent/speculative/ngram.py, draft_model.py)."""
from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from shm.step import StepInputs


class Proposer(Protocol):
    method: str  # its row's name in common/speculative.py

    def propose_step(self, x: StepInputs, starts: np.ndarray, rows: list[int],
                     histories: list[np.ndarray]) -> list[np.ndarray]:
        """Drafts for step rows `rows` (each with up to x.spec_len[r]) from their token histories."""

    def forget(self, seqs: Iterable[int]) -> None:
        """What it kept of these sequences is stale (freed, restarted, handed over)."""

    def reset(self) -> None: ...

    def graph_compiles(self) -> int:
        """Graphs its own model built (0 without one)."""

    def warmup(self) -> None:
        """Its own model's graphs, built before ready (nothing without one)."""
