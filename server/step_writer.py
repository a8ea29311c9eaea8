"""Write one scheduled step into an agent's arena (numpy, vectorised per row)."""
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
    off = 0
    for i, r in enumerate(rows):
        q = len(r.tokens)
        pos = np.arange(r.start_pos, r.start_pos + q, dtype=np.int32)
        table = np.asarray(r.block_table, np.int32)
        f["tokens"][off:off + q] = r.tokens
        f["positions"][off:off + q] = pos
        f["slots"][off:off + q] = table[pos // block_size] * block_size + pos % block_size
        off += q
        f["query_lens"][i] = q
        f["block_tables"][i, :len(table)] = table
        f["block_tables"][i, len(table):width] = 0
        f["seq_ids"][i] = r.seq_id
        f["sample"][i] = int(r.sample)
        f["prompt_len"][i] = r.prompt_len
        f["output_len"][i] = r.output_len
        p = r.params
        f["temperature"][i] = p.temperature
        f["top_k"][i] = p.top_k
        f["top_p"][i] = p.top_p
        f["min_p"][i] = p.min_p
        f["repetition_penalty"][i] = p.repetition_penalty
        f["presence_penalty"][i] = p.presence_penalty
        f["frequency_penalty"][i] = p.frequency_penalty
        f["seed"][i] = -1 if p.seed is None else p.seed
        f["n_logprobs"][i] = p.logprobs
    return n_tokens, len(rows), width
