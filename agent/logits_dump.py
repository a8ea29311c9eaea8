"""The contest's precision check, agent side: the raw full-vocabulary logits (float32, before
penalties and temperature) of each sampled row whose last fed token sits at an absolute position
that is a multiple of `every` (the contest's `current_index % 100 == 0`; the first sample of a
prompt of 101 tokens is at 100), one `.npy` each, named as the contest's agent named them:
`{time.time()}_{ids}_{position}.npy`, `ids` the first 20 characters of the prompt's ids written as
floats and run together (`1.020355.0915.0278.0`). `llm-serving --dump-logits DIR` turns it on (and
prefix caching off: every prompt is fed from its first token, as the contest's agent fed it);
`tools/test_serving_performance.py --precision-compare A B` compares two folders."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

ENV_DIR, ENV_EVERY = "LLM_SERVING_DUMP_LOGITS", "LLM_SERVING_DUMP_EVERY"
ID_CHARS = 20


def ids_key(tokens: list[int]) -> str:
    """The contest's name for a prompt: its ids as float64 strings, run together, cut at 20 characters."""
    out = ""
    for t in tokens:
        if len(out) >= ID_CHARS:
            break
        out += str(float(t))
    return out[:ID_CHARS]


class LogitsDump:
    def __init__(self, folder: Path, every: int):
        if every < 1:
            raise ValueError(f"logits dump: every {every} must be >= 1")
        self.folder, self.every = folder, every
        self.names: dict[int, str] = {}  # sequence id -> its prompt's ids key
        folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls) -> "LogitsDump | None":
        folder = os.environ.get(ENV_DIR)
        return cls(Path(folder), int(os.environ.get(ENV_EVERY, "100"))) if folder else None

    def started(self, seq: int, first_tokens: list[int]) -> None:
        """A sequence fed from position 0 (its prompt's first chunk): its name."""
        self.names[seq] = ids_key(first_tokens)

    def forget(self, seq: int) -> None:
        self.names.pop(seq, None)

    def write(self, logits: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """logits [R, V] of the rows about to sample; positions: each row's last fed token's."""
        for row, seq, pos in zip(logits, seq_ids.tolist(), positions.tolist()):
            if pos % self.every == 0:
                name = self.names.get(seq, f"req{seq}")  # first seen past position 0: never here without prefix hits
                np.save(self.folder / f"{time.time()}_{name}_{pos}.npy", np.asarray(row, np.float32))
