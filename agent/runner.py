"""ModelRunner: runs one step (arena views) as a single token-packed static-shape graph call, then samples.

A step is one flat list of T tokens from all its rows (decodes contribute one, prefill chunks
many), padded to a token bucket; the block-table width is fixed by max_model_len, so the graph set
is one graph per token bucket, every one built before the agent reports ready.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import QUANT_GROUP_SIZE
from agent import kernels
from agent.logits_dump import LogitsDump
from agent.calibrate import activation_ranges
from agent.graph_call import GraphCall
from agent.layers import Backend
from agent.model import LlamaConfig, LlamaModel
from agent.tensor_parallel import Group, shard
from agent.sampling import needs_penalty, sample
from common.memory import kv_dtype_for
from shm.step import SamplingColumns, StepInputs, StepView

log = logging.getLogger("llm_serving.agent")
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
    model_dtype: str = "float32"  # or "bfloat16" / "int8" projections (agent.layers; need the native kernels)
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (common.config.kv_dtype_for)
    int8_group: int = QUANT_GROUP_SIZE  # at most this many inputs per int8 scale (agent.quant.group_for; 0: 8 per row)
    tp: Group = Group()  # this runner's rank of a tensor-parallel group (agent.tensor_parallel)

    def __post_init__(self) -> None:
        self.token_buckets = sorted(set(self.token_buckets))
        if self.token_buckets[0] < 1 or self.max_running < 1:
            raise ValueError("token buckets and max_running must be positive")

    @classmethod
    def from_serving(cls, cfg: Any, tp: Group = Group()) -> "RunnerConfig":
        """The runner of a serving config (common.config.ServingConfig) on tensor-parallel rank `tp`."""
        return cls(num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                   token_buckets=cfg.token_buckets, max_running=cfg.max_running, mixed_tokens=cfg.mixed_step_tokens,
                   prefill_rows=cfg.max_prefill_rows, model_dtype=cfg.model_dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                   int8_group=cfg.quant_group_size, tp=tp)

    @property
    def width(self) -> int:
        """Block-table columns: fixed, so no graph depends on context length."""
        return -(-self.max_model_len // self.block_size)

    def rows_for(self, tokens: int) -> int:
        """Rows (block tables) of the graphs of a token bucket: never more than its tokens."""
        return min(tokens, self.max_running)

    def logit_rows_for(self, tokens: int) -> list[int]:
        """Rows the LM head runs on, per graph of a token bucket: all rows, or a few for the
        prefill-heavy steps of large buckets (measured, SmolLM2 on 2 cores: the LM head of 64 rows
        costs ~65 ms, 13-25% of a 128-256-token step that samples one or two)."""
        rows = self.rows_for(tokens)
        few = min(max(FEW_LOGIT_ROWS, self.prefill_rows), rows)
        if self.mixed_tokens and tokens > self.mixed_tokens:  # prefill-only: at most prefill_rows rows
            return [few]
        return sorted({few, rows})

    def graph_shapes(self) -> list[tuple[int, int, int]]:
        """(tokens, rows, logit rows) of every graph a step can run: all built before ready."""
        return [(t, self.rows_for(t), s) for t in self.token_buckets for s in self.logit_rows_for(t)]


def compile_cache_key(model_cfg: LlamaConfig, rc: RunnerConfig) -> str:
    """What the cached graphs depend on besides our sources: the model's shape, the KV pool and the
    exact warm-up sequence (MindSpore names cached graphs by compile order, see `freeze_compile_cache`)."""
    return (f"{model_cfg}|{rc.model_dtype}|{rc.kv_cache_dtype}|{rc.int8_group}|{rc.num_blocks}|{rc.block_size}|"
            f"{rc.max_model_len}|{rc.graph_shapes()}|tp{rc.tp.rank}/{rc.tp.size}")


def setup_mindspore(cache_dir: str | None = None, key: str = "", device_id: int = 0) -> tuple[str, int]:
    """Graph mode on the chosen device (LLM_SERVING_DEVICE, from serving_config.device) and
    `device_id`, with the on-disk compile cache in a folder keyed by our model source and `key`
    (compile_cache_key): MindSpore's own staleness check missed source changes and replayed a graph
    of the old code. Returns the device target and id MindSpore then reports."""
    import mindspore as ms

    if cache_dir:
        src = b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))  # all of agent/
        digest = hashlib.sha1(src + kernels.sources_digest().encode() + key.encode()).hexdigest()[:16]
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(Path(cache_dir) / digest)
    ms.set_context(mode=ms.GRAPH_MODE)
    device = os.environ.get("LLM_SERVING_DEVICE", "CPU")
    ms.set_device(device, device_id)
    if device == "CPU":
        # MindSpore's CPU kernels default to 25 threads whatever the machine: on our few pinned
        # cores they preempt each other. One per core we may run on.
        threads = int(os.environ.get("LLM_SERVING_CPU_THREADS", 0)) or len(os.sched_getaffinity(0))
        try:
            ms.device_context.cpu.op_tuning.threads_num(threads)
        except RuntimeError:  # set once per process; a later runner in the same process keeps it
            pass
    return str(ms.get_context("device_target")), int(ms.get_context("device_id"))


def freeze_compile_cache() -> None:
    """Stop using the on-disk compile cache once warm-up has built its fixed sequence of graphs.
    MindSpore names cached graphs by compile order (compile_cache_0, _1, ...) in one folder read once
    per process, so a graph first built under traffic (shapes met in any order) could be handed to
    another shape on the next start: Reshape size mismatch, and every later step failed. Warm-up
    order is fixed by the key, so its graphs still load from the cache; later ones are built anew."""
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"


class ModelRunner:
    def __init__(self, model_cfg: LlamaConfig, weights: dict[str, Any], rc: RunnerConfig, seed: int = 0,
                 calibration: list[int] | None = None):
        """`calibration`: token ids of agent.calibrate.CALIBRATION_TEXT, for int8 smoothing."""
        if rc.max_model_len > model_cfg.max_position:
            model_cfg.max_position = rc.max_model_len
        self.cfg, self.rc = model_cfg, rc
        lib = kernels.library() if rc.native_kernels else None
        self.native_kernels = lib is not None
        int8 = rc.model_dtype == "int8"
        ranges = activation_ranges(model_cfg, weights, calibration) if int8 and calibration else None
        backend = Backend(rc.model_dtype, lib, kv_dtype_for(rc.kv_cache_dtype, rc.model_dtype, lib is not None),
                          rc.int8_group, ranges, rc.tp.size)
        self.kv_dtype = backend.kv_dtype
        self.kernel_paths = kernels.kernel_paths(lib, rc.model_dtype)
        shard_cfg, weights = shard(model_cfg, weights, rc.tp, lib)  # tensor parallel: this rank's share
        self.model = LlamaModel(shard_cfg, weights, rc.num_blocks * rc.block_size, rc.block_size, backend)
        self.graph = GraphCall(self.model)
        self.rng = np.random.default_rng(seed)
        self.histories: dict[int, list[int]] = {}  # token history of rows that use penalties
        self.last: dict[int, int] = {}  # each sequence's last sampled token: what a fed row takes as input
        self.compiled: set[tuple[int, int, int]] = set()  # graph shapes built in this process
        self.dump = LogitsDump.from_env()  # the contest's raw-logit precision files (--dump-logits)

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
        """Logits [R, vocab] and log-sum-exp [R] at the last query token of every row, from one
        graph call over the packed tokens of all rows (`fed`: the tokens with fed rows filled in)."""
        qlens = x.query_lens
        n_rows, n_tokens = qlens.shape[0], x.tokens.shape[0]
        starts = self._starts(qlens, n_tokens)
        t_pad, r_pad = self.graph_for(x)
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
        logit_rows = np.zeros(bucket(n_rows, self.rc.logit_rows_for(t_pad)), np.int32)
        logit_rows[:n_rows] = starts + qlens - 1
        logits, lse = self._run(tokens, positions, slots, token_rows, tables, logit_rows)
        return logits[:n_rows], lse[:n_rows]

    def graph_for(self, x: StepInputs) -> tuple[int, int]:
        """(tokens, rows) of the graph that runs this step; ValueError if none can (checked before
        the model runs, so a bad step is refused without touching the runtime)."""
        self._starts(x.query_lens, x.tokens.shape[0])
        t_pad = bucket(x.tokens.shape[0], self.rc.token_buckets)
        r_pad = self.rc.rows_for(t_pad)
        if x.query_lens.shape[0] > r_pad:
            raise ValueError(f"{x.query_lens.shape[0]} rows exceed the {r_pad} of a {t_pad}-token step")
        if np.any(x.slots < self.rc.block_size):  # the stack op tells padding from tokens by it
            raise ValueError("block 0 is reserved for padding: no token of a step may write it")
        return t_pad, r_pad

    @staticmethod
    def _starts(qlens: np.ndarray, n_tokens: int) -> np.ndarray:
        if int(qlens.sum()) != n_tokens or np.any(qlens <= 0):
            raise ValueError("query_lens must be positive and sum to n_tokens")
        return (np.cumsum(qlens) - qlens).astype(np.int64)

    def step(self, v: StepView, free: list[int]) -> float:
        """Run one step described by arena views `v`; writes its outputs. Returns model seconds."""
        for seq in free:
            self.histories.pop(seq, None)
            self.last.pop(seq, None)
            if self.dump is not None:
                self.dump.forget(seq)
        x = v.inputs
        if x.query_lens.shape[0] == 0:  # nothing to compute (a `free`-only step, or an IPC probe)
            return 0.0
        starts = self._starts(x.query_lens, x.tokens.shape[0])
        tokens, unfed = self._feed(x, starts)
        self._track_histories(x, tokens, v.sampling, starts)
        t0 = time.perf_counter()
        logits, lse = self.forward(x, tokens)
        elapsed = time.perf_counter() - t0
        sampled = np.nonzero(x.sample)[0]
        # Where every row samples (decode steps), a slice: views instead of copies. The logits' copy
        # alone took ~65 us of a one-row SmolLM2 int8 step, cache-cold after the weights went through.
        rows = slice(0, sampled.size) if sampled.size == x.sample.shape[0] else sampled
        writes = self.rc.tp.rank == 0  # every rank samples alike (the same logits and seed); rank 0 writes
        if self.dump is not None and writes:  # before penalties change the logits in place
            self._dump(x, tokens, starts, logits[rows], rows)
        if sampled.size:
            hist = [self._history(int(x.seq_ids[r])) for r in sampled]
            res = sample(logits[rows], lse[rows], v.sampling.take(rows), hist, self.rng)
            res.ids[unfed[rows]] = -1  # its input was unknown: this row fails, its neighbours go on
            self.last.update(zip(x.seq_ids[rows].tolist(), res.ids.tolist()))
        if sampled.size and writes:
            out = v.outputs
            out.ids[rows] = res.ids
            out.logprobs[rows] = res.logprobs
            n = res.top_ids.shape[1]
            out.top_ids[rows, :n] = res.top_ids
            out.top_logprobs[rows, :n] = res.top_logprobs
        return elapsed

    def _feed(self, x: StepInputs, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's tokens with every fed row's token replaced by its sequence's last sample here,
        and which rows had none (a sequence this agent never sampled, or whose sampling failed)."""
        tokens = x.tokens
        unfed = np.zeros(x.feed.shape[0], bool)
        rows = np.nonzero(x.feed)[0]
        if rows.size:
            tokens = tokens.copy()  # the arena's inputs stay as the server wrote them
            last = np.array([self.last.get(int(s), -1) for s in x.seq_ids[rows]], np.int32)
            unfed[rows] = last < 0
            tokens[starts[rows]] = np.maximum(last, 0)
        return tokens, unfed

    def _dump(self, x: StepInputs, tokens: np.ndarray, starts: np.ndarray, logits: np.ndarray, rows: Any) -> None:
        """The contest's precision files (agent.logits_dump): names from prompts' first chunks."""
        for r in np.nonzero(x.positions[starts] == 0)[0]:
            self.dump.started(int(x.seq_ids[r]), tokens[starts[r]:starts[r] + x.query_lens[r]].tolist())
        last = (starts + x.query_lens - 1)[rows]
        if logits.shape[0]:
            self.dump.write(logits, x.seq_ids[rows], x.positions[last])

    def _track_histories(self, x: StepInputs, tokens: np.ndarray, cols: SamplingColumns, starts: np.ndarray) -> None:
        """Penalties need every token a sequence has fed; a chunk starting at position 0 restarts it."""
        for r in np.nonzero(needs_penalty(cols))[0]:
            s, q = starts[r], x.query_lens[r]
            seq = int(x.seq_ids[r])
            if x.positions[s] == 0:
                self.histories[seq] = []
            self.histories.setdefault(seq, []).extend(tokens[s:s + q].tolist())

    def _history(self, seq: int) -> np.ndarray | None:
        h = self.histories.get(seq)
        return None if h is None else np.asarray(h, np.int64)

    def reset(self) -> None:
        self.histories.clear()
        self.last.clear()

    def warmup(self) -> None:
        """Build every graph a step can run (one per token bucket) before traffic, in a fixed order:
        a compile under traffic stalls its step for seconds. Graphs load from the on-disk cache when
        it is warm; none is ever built after this."""
        shapes = self.rc.graph_shapes()
        every = max(1, len(shapes) // 4)  # progress in a few lines (each graph's own at DEBUG)
        start = time.monotonic()
        for i, (t, r, s) in enumerate(shapes, 1):
            t0 = time.monotonic()
            z = np.zeros(t, np.int32)
            self._run(z, z, z, np.full(t, r - 1, np.int32), np.zeros((r, self.rc.width), np.int32),
                      np.zeros(s, np.int32), compile_only=True)
            log.debug("graph %d/%d (%d tokens, %d rows, %d sampled) %.1fs", i, len(shapes), t, r, s,
                      time.monotonic() - t0)
            if i % every == 0 or i == len(shapes):
                log.info("building graphs: %d/%d (up to %d tokens) in %.1fs", i, len(shapes), t,
                         time.monotonic() - start)
        freeze_compile_cache()
