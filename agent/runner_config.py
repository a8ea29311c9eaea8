"""RunnerConfig: the step graphs an agent builds (token buckets, rows, sampled rows) and its KV pool.

A step is one flat list of T tokens from all its rows (decodes contribute one, prefill chunks
many), padded to a token bucket; the block-table width is fixed by max_model_len, so the graph set
is one graph per token bucket (and sampled-row count), every one built before the agent reports ready.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.config import QUANT_GROUP_SIZE, ServingConfig, int8_group
from common.cpu import cpu_flags
from agent.model_config import ModelConfig
from shm.step import StepInputs
from agent.tensor_parallel import Group

FEW_LOGIT_ROWS = 8  # a prefill-only step's chunks (prefill_batch_size, 4 by default) and a few decodes


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    token_buckets: list[int]  # padded token counts of a step, one graph each; the last is the most per step
    max_running: int  # sequences per step (serving_config: the last decode_batch_size)
    mixed_tokens: int = 0  # most tokens of a step with decodes; larger buckets serve prefill-only steps (0: all)
    prefill_rows: int = FEW_LOGIT_ROWS  # most prefill chunks per step (prefill_batch_size)
    native_kernels: bool = True  # agent/kernels CPU ops (paged attention, fused element-wise) when they build
    model_dtype: str = "float32"  # or "bfloat16" / "int8" projections (agent.model.norms; need the native kernels)
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (common.config.kv_dtype_for)
    int8_group: int = QUANT_GROUP_SIZE  # at most this many inputs per int8 scale (agent.model.quant.group_for; 0: 8 per row)
    tp: Group = Group()  # this runner's rank of a tensor-parallel group (agent.tensor_parallel)
    lora: tuple[int, int] = (0, 0)  # LoRA slots and rank (agent.model.lora): extra columns in every graph
    deterministic: bool = False  # batch-invariant kernels (agent/kernels/deterministic.h)

    def __post_init__(self) -> None:
        self.token_buckets = sorted(set(self.token_buckets))
        if self.token_buckets[0] < 1 or self.max_running < 1:
            raise ValueError("token buckets and max_running must be positive")

    @classmethod
    def from_serving(cls, cfg: ServingConfig, tp: Group = Group()) -> "RunnerConfig":
        """The runner of a serving config (common.config.ServingConfig) on tensor-parallel rank `tp`."""
        return cls(num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                   token_buckets=cfg.token_buckets, max_running=cfg.max_running, mixed_tokens=cfg.mixed_step_tokens,
                   prefill_rows=cfg.max_prefill_rows, model_dtype=cfg.model_dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                   int8_group=int8_group(cfg.quant_group_size, cpu_flags()), tp=tp,
                   lora=(cfg.max_loras, cfg.max_lora_rank) if cfg.lora_enabled else (0, 0), deterministic=cfg.deterministic)

    @property
    def width(self) -> int:
        """Block-table columns: fixed, so no graph depends on context length."""
        return -(-self.max_model_len // self.block_size)

    def rows_for(self, tokens: int) -> int:
        """Rows (block tables) of the graphs of a token bucket: never more than its tokens."""
        return min(tokens, self.max_running)

    def logit_rows_for(self, tokens: int) -> list[int]:
        """Rows the LM head runs on, per graph of a token bucket: all rows, or a few for the
        prefill-heavy steps of large buckets, where an LM head over every row would be a large share
        of a step that samples one or two (docs/perf-notes.md)."""
        rows = self.rows_for(tokens)
        few = min(max(FEW_LOGIT_ROWS, self.prefill_rows), rows)
        if self.mixed_tokens and tokens > self.mixed_tokens:  # prefill-only: at most prefill_rows rows
            return [few]
        return sorted({few, rows})

    def graph_shapes(self) -> list[tuple[int, int, int]]:
        """(tokens, rows, logit rows) of every graph a step can run: all built before ready."""
        return [(t, self.rows_for(t), s) for t in self.token_buckets for s in self.logit_rows_for(t)]


def compile_cache_key(model_cfg: ModelConfig, rc: RunnerConfig, draft: str = "") -> str:
    """What the cached graphs depend on besides our sources: the model's shape, the KV pool and the
    exact warm-up sequence (MindSpore names cached graphs by compile order, see `freeze_compile_cache`);
    `draft`: the draft model's graphs that follow (agent.speculative.draft_load.draft_key)."""
    return (f"{model_cfg}|{rc.model_dtype}|{rc.kv_cache_dtype}|{rc.int8_group}|{rc.num_blocks}|{rc.block_size}|"
            f"{rc.max_model_len}|{rc.graph_shapes()}|tp{rc.tp.rank}/{rc.tp.size}|lora{rc.lora}|draft{draft}")


def graph_for(x: StepInputs, rc: RunnerConfig) -> tuple[int, int]:
    """(tokens, rows) of the graph that runs this step; ValueError if none can (checked before
    the model runs, so a bad step is refused without touching the runtime)."""
    starts = row_starts(x.query_lens, x.tokens.shape[0])
    t_pad = bucket(x.tokens.shape[0], rc.token_buckets)
    r_pad = rc.rows_for(t_pad)
    if x.query_lens.shape[0] > r_pad:
        raise ValueError(f"{x.query_lens.shape[0]} rows exceed the {r_pad} of a {t_pad}-token step")
    heads, most = logit_positions(x, starts).size, max(rc.logit_rows_for(t_pad))
    if heads > most:
        raise ValueError(f"{heads} sampled and scored tokens exceed the {most} LM-head rows of a {t_pad}-token step")
    if np.any(x.slots < rc.block_size):  # the stack op tells padding from tokens by it
        raise ValueError("block 0 is reserved for padding: no token of a step may write it")
    return t_pad, r_pad


def logit_positions(x: StepInputs, starts: np.ndarray) -> np.ndarray:
    """Token indices the LM head runs on: every row's last token, then the scored tokens (prompt
    logprobs) that are not a row's last, then the verified tokens of rows with drafts (the fed one
    and every draft but the last)."""
    last = starts + x.query_lens - 1
    scored = np.nonzero(x.targets >= 0)[0]
    out = np.concatenate([last, np.setdiff1d(scored, last)]) if scored.size else last
    spec = np.nonzero(x.spec_len)[0]
    if spec.size:
        out = np.concatenate([out, *(np.arange(starts[r], starts[r] + x.spec_len[r]) for r in spec)])
    return out


def row_starts(qlens: np.ndarray, n_tokens: int) -> np.ndarray:
    """Each row's first token index in the packed step (ValueError unless the lengths add up)."""
    if int(qlens.sum()) != n_tokens or np.any(qlens <= 0):
        raise ValueError("query_lens must be positive and sum to n_tokens")
    return (np.cumsum(qlens) - qlens).astype(np.int64)
