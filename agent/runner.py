"""ModelRunner: turns one step (arena views) into padded static-shape graph calls, then samples.

Rows with one query token (decodes) run as one [P, 1] call; prefill chunks are grouped by their
query-length bucket into [P, Q] calls. P, Q and the block-table width are padded to buckets so
MindSpore compiles a handful of graphs once (and caches them on disk) instead of one per shape.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent import native
from agent.model import LlamaConfig, LlamaModel
from agent.sampling import SamplingRows, needs_penalty, sample


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pow2_buckets(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


@dataclass
class RunnerConfig:
    num_blocks: int
    block_size: int
    max_model_len: int
    decode_buckets: list[int]  # batch sizes of decode graphs
    prefill_buckets: list[int]  # query lengths of prefill graphs
    max_prefill_rows: int = 4  # short prompts fused into one [P, Q] prefill graph
    context_buckets: list[int] = field(default_factory=list)  # attention widths; empty = powers of 2
    native_kernels: bool = True  # agent/kernels CPU ops (paged attention, fused element-wise) when they build

    def __post_init__(self) -> None:
        ctx = [c for c in self.context_buckets if c < self.max_model_len]
        self.context_buckets = ctx + [self.max_model_len] if ctx else pow2_buckets(
            min(128, self.max_model_len), self.max_model_len)

    def warmup_shapes(self) -> list[tuple[int, int, int]]:
        """Every decode batch bucket and every prefill (rows, chunk) bucket at the shortest context:
        a compile stalls its step for seconds (7 s of queueing in a 2 req/s run when fused prefill
        rows compiled on first use), so every shape a short-context workload meets is built before
        traffic. Longer contexts compile on first use (then load from the on-disk cache)."""
        ctx = self.context_buckets[0]
        shapes = {(b, 1, ctx) for b in self.decode_buckets}
        shapes |= {(p, q, ctx) for p in pow2_buckets(1, self.max_prefill_rows) for q in self.prefill_buckets}
        return sorted(shapes)


def compile_cache_key(model_cfg: LlamaConfig, rc: RunnerConfig) -> str:
    """What the cached graphs depend on besides our sources: the model's shape, the KV pool and the
    exact warm-up sequence (MindSpore names cached graphs by compile order, see `freeze_compile_cache`)."""
    return f"{model_cfg}|{rc.num_blocks}|{rc.block_size}|{rc.max_model_len}|{rc.warmup_shapes()}"


def setup_mindspore(cache_dir: str | None = None, key: str = "") -> None:
    """Graph mode on the chosen device, with the on-disk compile cache in a folder keyed by our
    model source and `key` (compile_cache_key): MindSpore's own staleness check missed source
    changes and replayed a graph of the old code."""
    import mindspore as ms

    if cache_dir:
        src = b"".join(Path(__file__).with_name(f).read_bytes() for f in ("model.py", "runner.py"))
        digest = hashlib.sha1(src + native.sources_digest().encode() + key.encode()).hexdigest()[:16]
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(Path(cache_dir) / digest)
    ms.set_context(mode=ms.GRAPH_MODE)
    device = os.environ.get("LLM_SERVING_DEVICE", "CPU")
    ms.set_device(device)
    if device == "CPU":
        # MindSpore's CPU kernels default to 25 threads whatever the machine: on our few pinned
        # cores they preempt each other. One per core we may run on.
        threads = int(os.environ.get("LLM_SERVING_CPU_THREADS", 0)) or len(os.sched_getaffinity(0))
        try:
            ms.device_context.cpu.op_tuning.threads_num(threads)
        except RuntimeError:  # set once per process; a later runner in the same process keeps it
            pass


def freeze_compile_cache() -> None:
    """Stop using the on-disk compile cache once warm-up has built its fixed sequence of graphs.
    MindSpore names cached graphs by compile order (compile_cache_0, _1, ...) in one folder read once
    per process, so a graph first built under traffic (shapes met in any order) could be handed to
    another shape on the next start: Reshape size mismatch, and every later step failed. Warm-up
    order is fixed by the key, so its graphs still load from the cache; later ones are built anew."""
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"


class ModelRunner:
    def __init__(self, model_cfg: LlamaConfig, weights: dict[str, np.ndarray], rc: RunnerConfig, seed: int = 0):
        if rc.max_model_len > model_cfg.max_position:
            model_cfg.max_position = rc.max_model_len
        self.cfg, self.rc = model_cfg, rc
        lib = native.library() if rc.native_kernels else None
        self.native_kernels = lib is not None
        self.model = LlamaModel(model_cfg, weights, rc.num_blocks * rc.block_size, rc.block_size, lib)
        self.rng = np.random.default_rng(seed)
        self.histories: dict[int, list[int]] = {}  # token history of rows that use penalties
        self.compiled: set[tuple[int, int, int]] = set()

    # ------------------------------------------------------------ graph calls
    def _width_bucket(self, context: int) -> int:
        ctx = bucket(context, self.rc.context_buckets)
        return -(-ctx // self.rc.block_size)

    def _run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
             logit_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from mindspore import Tensor

        self.compiled.add((tokens.shape[0], tokens.shape[1], tables.shape[1]))
        logits, lse = self.model(Tensor(tokens), Tensor(positions), Tensor(slots), Tensor(tables),
                                 Tensor(logit_rows))
        return logits.asnumpy(), lse.asnumpy()

    def _call(self, rows: list[int], q_pad: int, p_pad: int, v: dict[str, np.ndarray],
              starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pack `rows` into a [p_pad, q_pad] call; returns logits/lse of each row's last token."""
        qlens = v["query_lens"]
        context = int(max(v["positions"][starts[r] + qlens[r] - 1] for r in rows)) + 1
        width = self._width_bucket(context)
        tokens = np.zeros((p_pad, q_pad), np.int32)
        positions = np.zeros((p_pad, q_pad), np.int32)
        slots = np.zeros((p_pad, q_pad), np.int32)  # padding writes into reserved block 0
        tables = np.zeros((p_pad, width), np.int32)
        have = min(width, v["block_tables"].shape[1])
        for i, r in enumerate(rows):
            s, q = starts[r], qlens[r]
            tokens[i, :q] = v["tokens"][s:s + q]
            positions[i, :q] = v["positions"][s:s + q]
            slots[i, :q] = v["slots"][s:s + q]
            tables[i, :have] = v["block_tables"][r, :have]
        logit_rows = np.arange(p_pad, dtype=np.int32) * q_pad
        logit_rows[:len(rows)] += qlens[rows] - 1
        logits, lse = self._run(tokens, positions, slots.reshape(-1), tables, logit_rows)
        return logits[:len(rows)], lse[:len(rows)]

    # ------------------------------------------------------------ step
    def forward(self, v: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Logits [R, vocab] and log-sum-exp [R] at the last query token of every row."""
        qlens = v["query_lens"]
        n_rows = qlens.shape[0]
        starts = self._starts(qlens, v["tokens"].shape[0])
        logits = np.zeros((n_rows, self.cfg.vocab_size), np.float32)
        lse = np.zeros(n_rows, np.float32)
        decodes = [r for r in range(n_rows) if qlens[r] == 1]
        biggest = self.rc.decode_buckets[-1]
        for i in range(0, len(decodes), biggest):
            group = decodes[i:i + biggest]
            logits[group], lse[group] = self._call(group, 1, bucket(len(group), self.rc.decode_buckets), v, starts)
        by_q: dict[int, list[int]] = {}
        for r in range(n_rows):
            if qlens[r] > 1:
                by_q.setdefault(bucket(int(qlens[r]), self.rc.prefill_buckets), []).append(r)
        p_buckets = pow2_buckets(1, self.rc.max_prefill_rows)
        for q_pad, group_rows in sorted(by_q.items()):
            for i in range(0, len(group_rows), self.rc.max_prefill_rows):
                group = group_rows[i:i + self.rc.max_prefill_rows]
                logits[group], lse[group] = self._call(group, q_pad, bucket(len(group), p_buckets), v, starts)
        return logits, lse

    @staticmethod
    def _starts(qlens: np.ndarray, n_tokens: int) -> np.ndarray:
        if int(qlens.sum()) != n_tokens or np.any(qlens <= 0):
            raise ValueError("query_lens must be positive and sum to n_tokens")
        return np.concatenate([[0], np.cumsum(qlens)[:-1]]).astype(np.int64)

    def step(self, v: dict[str, np.ndarray], free: list[int]) -> float:
        """Run one step described by arena views `v`; writes out_* fields. Returns model seconds."""
        for seq in free:
            self.histories.pop(seq, None)
        self._track_histories(v, self._starts(v["query_lens"], v["tokens"].shape[0]))
        t0 = time.perf_counter()
        logits, lse = self.forward(v)
        elapsed = time.perf_counter() - t0
        sampled = np.nonzero(v["sample"])[0]
        if sampled.size:
            params = SamplingRows(**{f: v[f][sampled] for f in SamplingRows.__dataclass_fields__})
            hist = [self._history(int(v["seq_ids"][r])) for r in sampled]
            res = sample(logits[sampled], lse[sampled], params, hist, self.rng)
            v["out_ids"][sampled] = res.ids
            v["out_logprobs"][sampled] = res.logprobs
            n = res.top_ids.shape[1]
            v["out_top_ids"][sampled, :n] = res.top_ids
            v["out_top_logprobs"][sampled, :n] = res.top_logprobs
        return elapsed

    def _track_histories(self, v: dict[str, np.ndarray], starts: np.ndarray) -> None:
        """Penalties need every token a sequence has fed; a chunk starting at position 0 restarts it."""
        pen = SamplingRows(**{f: v[f] for f in SamplingRows.__dataclass_fields__})
        for r in np.nonzero(needs_penalty(pen))[0]:
            s, q = starts[r], v["query_lens"][r]
            seq = int(v["seq_ids"][r])
            if v["positions"][s] == 0:
                self.histories[seq] = []
            self.histories.setdefault(seq, []).extend(v["tokens"][s:s + q].tolist())

    def _history(self, seq: int) -> np.ndarray | None:
        h = self.histories.get(seq)
        return None if h is None else np.asarray(h, np.int64)

    def reset(self) -> None:
        self.histories.clear()

    def warmup(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile (P, Q, context) graphs ahead of traffic, in the given (fixed) order; graphs
        built later never touch the on-disk cache."""
        for p, q, ctx in shapes:
            width = self._width_bucket(ctx)
            z = np.zeros((p, q), np.int32)
            self._run(z, z, z.reshape(-1), np.zeros((p, width), np.int32),
                      np.arange(p, dtype=np.int32) * q)
        freeze_compile_cache()
