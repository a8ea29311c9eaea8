"""A step's rows packed into one graph call's static shapes (agent.runner_config's buckets): every
row's tokens back to back, padded to the token bucket, each token told its row, position, KV slot
and LoRA adapter, and the logit rows to keep."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from agent.runner_config import RunnerConfig, bucket, graph_for, logit_positions, row_starts
from shm.step import StepInputs


class GraphInputs(NamedTuple):
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    token_rows: np.ndarray
    tables: np.ndarray
    logit_rows: np.ndarray
    adapters: np.ndarray | None  # each token's LoRA adapter (0: none, k: slot k - 1); None: none at all

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, rows, logit rows): which graph runs it."""
        return self.tokens.shape[0], self.tables.shape[0], self.logit_rows.shape[0]


def pack(x: StepInputs, fed: np.ndarray | None, rc: RunnerConfig) -> tuple[GraphInputs, int]:
    """`x` (`fed`: its tokens with fed rows filled in) as one graph call's inputs, and how many of its
    logit rows are real (the last query token of every row first)."""
    qlens = x.query_lens
    n_rows, n_tokens = qlens.shape[0], x.tokens.shape[0]
    t_pad, r_pad = graph_for(x, rc)
    where = logit_positions(x, row_starts(qlens, n_tokens))
    g = padding(t_pad, r_pad, bucket(where.size, rc.logit_rows_for(t_pad)), rc.width)
    # Padding tokens get a row of their own when there is one (an all-zero table: slot 0).
    g.token_rows[:] = min(n_rows, r_pad - 1)
    g.tokens[:n_tokens] = x.tokens if fed is None else fed
    g.positions[:n_tokens] = x.positions
    g.slots[:n_tokens] = x.slots
    g.token_rows[:n_tokens] = np.repeat(np.arange(n_rows, dtype=np.int32), qlens)
    have = min(rc.width, x.block_tables.shape[1])
    g.tables[:n_rows, :have] = x.block_tables[:, :have]
    g.logit_rows[:where.size] = where
    if x.adapter.any():
        adapters = np.zeros(t_pad, np.int32)
        adapters[:n_tokens] = np.repeat(x.adapter, qlens)
        g = g._replace(adapters=adapters)
    return g, where.size


def padding(tokens: int, rows: int, logit_rows: int, width: int) -> GraphInputs:
    """A graph call of nothing but padding: every token in the last row, whose table is all zeros
    (padding writes into reserved block 0)."""
    z = np.zeros(tokens, np.int32)
    return GraphInputs(z, z.copy(), z.copy(), np.full(tokens, rows - 1, np.int32), np.zeros((rows, width), np.int32),
                       np.zeros(logit_rows, np.int32), None)
