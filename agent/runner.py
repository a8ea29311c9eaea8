"""ModelRunner: runs one step (arena views) as a single token-packed static-shape graph call, then
samples. The graphs it builds are RunnerConfig's (agent.runner_config), all before ready."""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from agent import kernels
from agent.calibrate import activation_ranges
from agent.graph_call import GraphCall, freeze_compile_cache
from agent.backend import Backend
from agent.model import LlamaConfig, LlamaModel
from agent.runner_config import RunnerConfig, bucket
from agent.sampling import sample, score
from agent.sequences import SequenceState
from agent.tensor_parallel import shard
from common.memory import kv_dtype_for
from shm.step import StepInputs, StepView

log = logging.getLogger("llm_serving.agent")


class ModelRunner:
    def __init__(self, model_cfg: LlamaConfig, weights: dict[str, Any], rc: RunnerConfig, seed: int = 0,
                 calibration: list[int] | None = None):
        """`calibration`: token ids of agent.calibrate.CALIBRATION_TEXT, for int8 smoothing."""
        if rc.max_model_len > model_cfg.max_position:
            model_cfg.max_position = rc.max_model_len
        self.cfg, self.rc = model_cfg, rc
        self.lib = lib = kernels.library() if rc.native_kernels else None
        self.native_kernels = lib is not None
        int8 = rc.model_dtype == "int8"
        ranges = activation_ranges(model_cfg, weights, calibration) if int8 and calibration else None
        backend = Backend(rc.model_dtype, lib, kv_dtype_for(rc.kv_cache_dtype, rc.model_dtype, lib is not None),
                          rc.int8_group, ranges, rc.tp.size)
        self.kv_dtype = backend.kv_dtype
        self.kernel_paths = kernels.kernel_paths(lib, rc.model_dtype, rc.int8_group)
        shard_cfg, weights = shard(model_cfg, weights, rc.tp, lib)  # tensor parallel: this rank's share
        self.model = LlamaModel(shard_cfg, weights, rc.num_blocks * rc.block_size, rc.block_size, backend)
        self.graph = GraphCall(self.model)
        self.rng = np.random.default_rng(seed)
        self.seqs = SequenceState()
        self.compiled: set[tuple[int, int, int]] = set()  # graph shapes built in this process

    @property
    def graph_compiles(self) -> int:
        return len(self.compiled)

    # ------------------------------------------------------------ graph call
    def _run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, token_rows: np.ndarray,
             tables: np.ndarray, logit_rows: np.ndarray, compile_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        from mindspore import Tensor

        self.compiled.add((tokens.shape[0], tables.shape[0], logit_rows.shape[0]))
        # Wrapped, not copied (the arrays are this call's own): 10 against 93 us for the six (Zen 3).
        args = [Tensor.from_numpy(a) for a in (tokens, positions, slots, token_rows, tables, logit_rows)]
        if compile_only:  # build (or load) the graph without running it: 0.2-0.6 s less per graph
            self.graph.compile(*args)
            return np.empty(0), np.empty(0)
        logits, lse = self.graph(*args)
        return logits.asnumpy(), lse.asnumpy()

    def forward(self, x: StepInputs, fed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Logits [P, vocab] and log-sum-exp [P] at the `logit_positions` (the last query token of
        every row first), from one graph call over the packed tokens of all rows (`fed`: the tokens
        with fed rows filled in)."""
        qlens = x.query_lens
        n_rows, n_tokens = qlens.shape[0], x.tokens.shape[0]
        starts = row_starts(qlens, n_tokens)
        t_pad, r_pad = self.graph_for(x)
        where = logit_positions(x, starts)
        tokens = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slots = np.zeros(t_pad, np.int32)  # padding writes into reserved block 0
        # Padding tokens get a row of their own when there is one (an all-zero table: slot 0).
        token_rows = np.full(t_pad, min(n_rows, r_pad - 1), np.int32)
        tables = np.zeros((r_pad, self.rc.width), np.int32)
        tokens[:n_tokens] = x.tokens if fed is None else fed
        positions[:n_tokens] = x.positions
        slots[:n_tokens] = x.slots
        token_rows[:n_tokens] = np.repeat(np.arange(n_rows, dtype=np.int32), qlens)
        have = min(self.rc.width, x.block_tables.shape[1])
        tables[:n_rows, :have] = x.block_tables[:, :have]
        logit_rows = np.zeros(bucket(where.size, self.rc.logit_rows_for(t_pad)), np.int32)
        logit_rows[:where.size] = where
        logits, lse = self._run(tokens, positions, slots, token_rows, tables, logit_rows)
        return logits[:where.size], lse[:where.size]

    def graph_for(self, x: StepInputs) -> tuple[int, int]:
        """(tokens, rows) of the graph that runs this step; ValueError if none can (checked before
        the model runs, so a bad step is refused without touching the runtime)."""
        starts = row_starts(x.query_lens, x.tokens.shape[0])
        t_pad = bucket(x.tokens.shape[0], self.rc.token_buckets)
        r_pad = self.rc.rows_for(t_pad)
        if x.query_lens.shape[0] > r_pad:
            raise ValueError(f"{x.query_lens.shape[0]} rows exceed the {r_pad} of a {t_pad}-token step")
        heads, most = logit_positions(x, starts).size, max(self.rc.logit_rows_for(t_pad))
        if heads > most:
            raise ValueError(f"{heads} sampled and scored tokens exceed the {most} LM-head rows of a {t_pad}-token step")
        if np.any(x.slots < self.rc.block_size):  # the stack op tells padding from tokens by it
            raise ValueError("block 0 is reserved for padding: no token of a step may write it")
        return t_pad, r_pad

    def step(self, v: StepView, free: list[int], grammars: list[list[Any]] | None = None) -> float:
        """Run one step described by arena views `v`; writes its outputs. Returns model seconds.
        `grammars`: the constrained sequences it (re)admits (agent/grammar.py)."""
        self.seqs.free(free)
        self.seqs.start_grammars(grammars or [])
        x = v.inputs
        if x.query_lens.shape[0] == 0:  # nothing to compute (a `free`-only step, or an IPC probe)
            return 0.0
        starts = row_starts(x.query_lens, x.tokens.shape[0])
        tokens, unfed = self.seqs.feed(x, starts)
        self.seqs.track(x, tokens, v.sampling, starts)
        t0 = time.perf_counter()
        logits, lse = self.forward(x, tokens)
        elapsed = time.perf_counter() - t0
        writes = self.rc.tp.rank == 0  # every rank samples alike (the same logits and seed); rank 0 writes
        if v.scores.score_logprobs.size and writes:  # prompt logprobs, before anything changes the logits
            score(x, v.sampling, starts, logit_positions(x, starts), logits, lse, v.scores)
        sampled = np.nonzero(x.sample)[0]
        # Where every row samples (decode steps), a slice: views instead of copies. The logits' copy
        # alone took ~65 us of a one-row SmolLM2 int8 step, cache-cold after the weights went through.
        rows = slice(0, sampled.size) if sampled.size == x.sample.shape[0] else sampled
        if self.seqs.dump is not None and writes:  # before penalties change the logits in place
            self.seqs.write_dump(x, tokens, starts, logits[rows], rows)
        if sampled.size:
            hist = [self.seqs.history(int(x.seq_ids[r])) for r in sampled]
            lg = logits[rows]
            g = self.seqs.grammars
            constrained = g.constrained(x.seq_ids[rows]) if g is not None else []
            failed = g.mask(lg, constrained) if constrained else None
            res = sample(lg, lse[rows], v.sampling.take(rows), hist, self.rng)
            res.ids[unfed[rows]] = -1  # its input was unknown: this row fails, its neighbours go on
            if constrained:
                res.ids[failed] = -1  # its grammar is in error: this row fails
                g.consume(constrained, res.ids)
            self.seqs.sampled(x.seq_ids[rows], res.ids)
        if sampled.size and writes:
            out = v.outputs
            out.ids[rows] = res.ids
            out.logprobs[rows] = res.logprobs
            n = res.top_ids.shape[1]
            out.top_ids[rows, :n] = res.top_ids
            out.top_logprobs[rows, :n] = res.top_logprobs
        return elapsed

    def reset(self) -> None:
        self.seqs.reset()

    def warmup(self) -> None:
        """Build every graph a step can run (one per token bucket) before traffic, in a fixed order:
        a compile under traffic stalls its step for seconds. Graphs load from the on-disk cache when
        it is warm; none is ever built after this."""
        shapes = self.rc.graph_shapes()
        start = time.monotonic()
        for i, (t, r, s) in enumerate(shapes, 1):
            t0 = time.monotonic()
            z = np.zeros(t, np.int32)
            self._run(z, z, z, np.full(t, r - 1, np.int32), np.zeros((r, self.rc.width), np.int32),
                      np.zeros(s, np.int32), compile_only=True)
            log.debug("graph %d/%d (%d tokens, %d rows, %d sampled) %.1fs", i, len(shapes), t, r, s,
                      time.monotonic() - t0)
            if i == len(shapes) // 2:  # progress in one line (each graph's own at DEBUG)
                log.info("building graphs: %d/%d (up to %d tokens) in %.1fs", i, len(shapes), t,
                         time.monotonic() - start)
        freeze_compile_cache()


def logit_positions(x: StepInputs, starts: np.ndarray) -> np.ndarray:
    """Token indices the LM head runs on: every row's last token, then the scored tokens (prompt
    logprobs) that are not a row's last."""
    last = starts + x.query_lens - 1
    scored = np.nonzero(x.targets >= 0)[0]
    return np.concatenate([last, np.setdiff1d(scored, last)]) if scored.size else last


def row_starts(qlens: np.ndarray, n_tokens: int) -> np.ndarray:
    """Each row's first token index in the packed step (ValueError unless the lengths add up)."""
    if int(qlens.sum()) != n_tokens or np.any(qlens <= 0):
        raise ValueError("query_lens must be positive and sum to n_tokens")
    return (np.cumsum(qlens) - qlens).astype(np.int64)
