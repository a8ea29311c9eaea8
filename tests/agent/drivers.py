"""Test drivers of the agent's model runner, shared by the agent tests: a tiny runner, and the
bookkeeping a server would do around it (PagedDriver: prefill then greedy decode; SpecDriver: fed
decodes with drafts)."""
from __future__ import annotations

import numpy as np

from agent.graph_call import setup_mindspore
from agent.runner import ModelRunner
from agent.runner_config import RunnerConfig
from server.sampling_params import SamplingParams
from shm.arena import Arena, ArenaSpec
from shm.step import RowInput, read_drafts
from tests.conftest import tiny_model_config


LOGIT_TOL = 1e-3
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [250, 1, 2], list(range(30, 70)), [9]]
TOKEN_BUCKETS = [1, 2, 4, 8, 16, 64, 128]
# The plain path's graphs take seconds each to build: one bucket holds every step PagedDriver runs
# on PROMPTS (a decode step pads to it).
PLAIN_BUCKETS = [64]


def make_runner(weights, block_size: int, num_blocks: int = 0, native: bool = True,
                dtype: str = "float32", kv_dtype: str = "auto", deterministic: bool = False) -> ModelRunner:
    setup_mindspore()
    num_blocks = num_blocks or 1 + 4 * (-(-128 // block_size)) + 8
    rc = RunnerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=128,
                      token_buckets=TOKEN_BUCKETS if native else PLAIN_BUCKETS, max_running=16, native_kernels=native,
                      model_dtype=dtype, kv_cache_dtype=kv_dtype, deterministic=deterministic)
    runner = ModelRunner(tiny_model_config(), weights, rc)
    assert runner.native_kernels == native  # CI machines have a C++ compiler: the kernels must build
    runner.warmup()
    return runner


class PagedDriver:
    """Minimal sequence bookkeeping: whole-prompt prefill, then greedy decode, all rows per step."""

    def __init__(self, runner: ModelRunner, params: SamplingParams | None = None):
        self.runner, self.bs = runner, runner.rc.block_size
        self.arena = Arena.private(ArenaSpec(512, 16, runner.rc.max_model_len // self.bs + 1))
        self.next_block = 1  # block 0 is reserved for padding writes
        self.params = params or SamplingParams()

    def _table(self, length: int, table: list[int]) -> list[int]:
        while len(table) * self.bs < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def run(self, prompts: list[list[int]], steps: int, collect_logits: bool = True):
        seqs = [list(p) for p in prompts]
        tables: list[list[int]] = [[] for _ in prompts]
        fed = [0] * len(prompts)
        all_logits: list[list[np.ndarray]] = [[] for _ in prompts]
        for _ in range(steps + 1):
            rows = []
            for i, s in enumerate(seqs):
                rows.append(RowInput(i, np.asarray(s[fed[i]:], np.int32), fed[i], self._table(len(s), tables[i]),
                                     True, self.params, len(prompts[i]), len(s) - len(prompts[i])))
            v = self.arena.step(self.arena.write_step(rows, self.bs))
            if collect_logits:
                logits, _ = self.runner.forward(v.inputs)
                for i in range(len(seqs)):
                    all_logits[i].append(logits[i].copy())
            self.runner.step(v, [])
            for i, s in enumerate(seqs):
                fed[i] = len(s)
                s.append(int(v.outputs.ids[i]))
        return seqs, all_logits


class SpecDriver:
    """Prefill each prompt, then fed decode rows with `k` drafts each (0: plain decoding), all rows
    per step; tokens are appended from each row's accepted drafts and its last token."""

    def __init__(self, runner, params: SamplingParams, k: int):
        self.runner, self.params, self.k, self.bs = runner, params, k, runner.rc.block_size
        self.arena = Arena.private(ArenaSpec(256, 16, runner.rc.max_model_len // self.bs + 1))
        self.next_block, self.accepted, self.short = 1, 0, 0  # drafts kept; rows the proposer left slots empty in

    def _table(self, length: int, table: list[int]) -> list[int]:
        while len(table) * self.bs < length:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def run(self, prompts: list[list[int]], n_new: int, seq0: int = 0) -> list[list[int]]:
        seqs, tables = [list(p) for p in prompts], [[] for _ in prompts]
        rows = [RowInput(seq0 + i, np.asarray(p, np.int32), 0, self._table(len(p), tables[i]), True, self.params,
                         len(p), 0) for i, p in enumerate(prompts)]
        self._step(rows, seqs)
        while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < n_new:
            rows = []
            for i, (s, p) in enumerate(zip(seqs, prompts)):
                k = max(0, min(self.k, n_new - (len(s) - len(p)) - 1))
                rows.append(RowInput(seq0 + i, np.zeros(1 + k, np.int32), len(s) - 1,
                                     self._table(len(s) + k, tables[i]), True, self.params, len(p), len(s) - len(p),
                                     feed=True, spec=k))
            self._step(rows, seqs)
        return [s[:len(p) + n_new] for s, p in zip(seqs, prompts)]

    def _step(self, rows: list[RowInput], seqs: list[list[int]]) -> None:
        dims = self.arena.write_step(rows, self.bs)
        v = self.arena.step(dims)
        self.runner.step(v, [])
        first = 0
        for r, row in enumerate(rows):
            a = int(v.outputs.accepted[r])
            assert a <= v.outputs.drafted[r] <= row.spec
            self.short += int(v.outputs.drafted[r] < row.spec)
            seqs[r].extend(
                [d.token for d in read_drafts(v.drafts, first, a, 0)] + [int(v.outputs.ids[r])])
            first += row.spec
            self.accepted += a
