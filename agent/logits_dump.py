"""The contest's precision check, agent side: the raw full-vocabulary logits (float32, before
penalties and temperature) of every sampled row at generated positions 0, every, 2*every, ..., one
`.npy` per row and position, named `<time>_req<sequence id>_pos<position>.npy` (the time first, so
a folder sorts in the order they were written). `llm-serving --dump-logits DIR` turns it on;
`tools/test_serving_performance.py --precision-compare A B` compares two folders."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

ENV_DIR, ENV_EVERY = "LLM_SERVING_DUMP_LOGITS", "LLM_SERVING_DUMP_EVERY"


class LogitsDump:
    def __init__(self, folder: Path, every: int):
        if every < 1:
            raise ValueError(f"logits dump: every {every} must be >= 1")
        self.folder, self.every = folder, every
        folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls) -> "LogitsDump | None":
        folder = os.environ.get(ENV_DIR)
        return cls(Path(folder), int(os.environ.get(ENV_EVERY, "100"))) if folder else None

    def write(self, logits: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """logits [R, V] of the rows about to sample; positions: tokens each has generated so far."""
        for row, seq, pos in zip(logits, seq_ids.tolist(), positions.tolist()):
            if pos % self.every == 0:
                stamp = f"{time.strftime('%Y%m%d%H%M%S')}{time.time_ns() % 10**9:09d}"
                np.save(self.folder / f"{stamp}_req{seq}_pos{pos}.npy", np.asarray(row, np.float32))
