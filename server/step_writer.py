"""Write one scheduled step into an agent's arena: whole-array numpy writes per field, not per row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.sampling_params import SamplingParams
from shm.arena import Arena


@dataclass
class RowInput:
    seq_id: int
    tokens: np.ndarray  # int32 query tokens of this step
    start_pos: int  # position of tokens[0]
    block_table: list[int]
    sample: bool  # sample a token after the last query token
    params: SamplingParams
    prompt_len: int
    output_len: int


def write_step(arena: Arena, rows: list[RowInput], block_size: int) -> tuple[int, int, int]:
    """Returns (n_tokens, n_rows, width) for the step header."""
    f = arena.fields
    n_tokens = sum(len(r.tokens) for r in rows)
    width = max(len(r.block_table) for r in rows)
    if n_tokens > arena.spec.max_tokens or len(rows) > arena.spec.max_rows or width > arena.spec.max_blocks:
        raise ValueError("step exceeds the arena capacity")
    n = len(rows)
    qlens = np.fromiter((len(r.tokens) for r in rows), np.int32, n)
    tables = np.zeros((n, width), np.int32)
    for i, r in enumerate(rows):
        tables[i, :len(r.block_table)] = r.block_table
    # Per-token fields in whole-array operations: each row's positions run on from its start.
    row_of = np.repeat(np.arange(n), qlens)
    first = np.cumsum(qlens) - qlens
    pos = (np.fromiter((r.start_pos for r in rows), np.int32, n)[row_of]
           + np.arange(n_tokens, dtype=np.int32) - first[row_of]).astype(np.int32)
    f["tokens"][:n_tokens] = np.concatenate([r.tokens for r in rows])
    f["positions"][:n_tokens] = pos
    f["slots"][:n_tokens] = tables[row_of, pos // block_size] * block_size + pos % block_size
    f["query_lens"][:n] = qlens
    f["block_tables"][:n, :width] = tables
    for name, values in (
            ("seq_ids", [r.seq_id for r in rows]), ("sample", [int(r.sample) for r in rows]),
            ("prompt_len", [r.prompt_len for r in rows]), ("output_len", [r.output_len for r in rows]),
            ("temperature", [r.params.temperature for r in rows]), ("top_k", [r.params.top_k for r in rows]),
            ("top_p", [r.params.top_p for r in rows]), ("min_p", [r.params.min_p for r in rows]),
            ("repetition_penalty", [r.params.repetition_penalty for r in rows]),
            ("presence_penalty", [r.params.presence_penalty for r in rows]),
            ("frequency_penalty", [r.params.frequency_penalty for r in rows]),
            ("seed", [-1 if r.params.seed is None else r.params.seed for r in rows]),
            ("n_logprobs", [r.params.logprobs for r in rows])):
        f[name][:n] = values
    return n_tokens, n, width
