"""ModelRunner: runs one step (arena views) as a single token-packed static-shape graph call, then
samples. The graphs it builds are RunnerConfig's (agent.runner_config), all before ready."""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from agent import kernels
from agent.model.calibrate import activation_ranges
from agent.graph_call import GraphCall, freeze_compile_cache
from agent.model.backend import Backend
from agent.model_config import ModelConfig
from agent.model.decoder import DecoderModel
from agent.model.lora import write_slot
from agent.runner_config import RunnerConfig, bucket, graph_for, logit_positions, row_starts
from agent.grammar import Grammars
from agent.sampling import sample, score
from agent.sequences import SequenceState
from agent.spec.verify import heads, verify, without_unfilled, write_drafts
from agent.tensor_parallel import shard, shard_adapter
from common.memory import kv_dtype_for
from shm.step import StepInputs, StepOutputs, StepView

log = logging.getLogger("llm_serving.agent")


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, Any], rc: RunnerConfig, seed: int = 0,
                 calibration: list[int] | None = None, grammar_tokenizer: Any = None, proposer: Any = None,
                 lora: Any = None):
        """`calibration`: token ids of agent.model.calibrate.CALIBRATION_TEXT (int8 smoothing);
        `grammar_tokenizer`: common.grammar.ll_tokenizer's, for constrained decoding; `proposer`:
        what drafts the rows that ask for drafts (agent/spec/), else they get none; `lora`: the
        LoRA adapters' slots (agent.model.lora.LoraSlots), which rows pick by their `adapter`."""
        if rc.max_model_len > model_cfg.max_position:
            model_cfg.max_position = rc.max_model_len
        self.cfg, self.rc = model_cfg, rc
        self.lib = lib = kernels.library() if rc.native_kernels else None
        self.native_kernels = lib is not None
        int8 = rc.model_dtype == "int8"
        if lora is not None:  # tensor parallel: each adapter split as its base projections are
            lora.adapters = [shard_adapter(a, model_cfg, rc.tp) for a in lora.adapters]
        ranges = activation_ranges(model_cfg, weights, calibration) if int8 and calibration else None
        backend = Backend(rc.model_dtype, lib, kv_dtype_for(rc.kv_cache_dtype, rc.model_dtype, lib is not None),
                          rc.int8_group, ranges, rc.tp.size, lora)
        self.kv_dtype = backend.kv_dtype
        self.kernel_paths = kernels.kernel_paths(lib, rc.model_dtype, rc.int8_group)
        shard_cfg, weights = shard(model_cfg, weights, rc.tp, lib)  # tensor parallel: this rank's share
        self.model = DecoderModel(shard_cfg, weights, rc.num_blocks * rc.block_size, rc.block_size, backend)
        self.graph = GraphCall(self.model)
        self.lora, self.lora_slots = lora, lora.slots if lora is not None else 0
        if rc.lora != (self.lora_slots, lora.rank if lora else 0):  # the compile-cache key names rc's
            raise ValueError(f"RunnerConfig.lora {rc.lora}: the model's LoRA slots and rank differ")
        self.rng = np.random.default_rng(seed)
        self.seqs = SequenceState(proposer)
        if grammar_tokenizer is not None:
            self.seqs.grammars = Grammars(grammar_tokenizer, model_cfg.vocab_size, lib)
        self.compiled: set[tuple[int, int, int]] = set()  # graph shapes built in this process
        self.warmed: set[tuple[int, int, int]] = set()  # graph shapes warm-up ran (their buffers exist)

    @property
    def draft(self) -> "ModelRunner | None":
        """The draft model's runner (speculative self_int8 / draft), else None."""
        return getattr(self.seqs.proposer, "runner", None)

    @property
    def graph_compiles(self) -> int:
        return len(self.compiled) + (self.draft.graph_compiles if self.draft is not None else 0)

    # ------------------------------------------------------------ graph call
    def _run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, token_rows: np.ndarray,
             tables: np.ndarray, logit_rows: np.ndarray, compile_only: bool = False,
             adapters: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One graph call; `adapters`: each token's LoRA adapter (0: none, k: slot k - 1)."""
        from mindspore import Tensor

        self.compiled.add((tokens.shape[0], tables.shape[0], logit_rows.shape[0]))
        arrays = [tokens, positions, slots, token_rows, tables, logit_rows]
        if self.model.lora is not None:  # each token's adapter slot, one-hot (padding: none)
            mask = np.zeros((tokens.shape[0], self.lora_slots), np.float32)
            if adapters is not None:
                on = np.nonzero(adapters > 0)[0]
                mask[on, adapters[on] - 1] = 1.0
            arrays.append(mask)
        # Wrapped, not copied: the arrays are this call's own (docs/perf-notes.md).
        args = [Tensor.from_numpy(a) for a in arrays]
        if compile_only:  # build (or load) the graph without running it: faster than a first run
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
        t_pad, r_pad = graph_for(x, self.rc)
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
        adapters = None
        if x.adapter.any():
            adapters = np.zeros(t_pad, np.int32)
            adapters[:n_tokens] = np.repeat(x.adapter, qlens)
        logits, lse = self._run(tokens, positions, slots, token_rows, tables, logit_rows, adapters=adapters)
        return logits[:where.size], lse[:where.size]

    def step(self, v: StepView, free: list[int], grammars: list[list[Any]] | None = None,
             histories: list[list[Any]] | None = None) -> float:
        """Run one step described by arena views `v` and write its outputs: its inputs (fed tokens
        filled in), the forward, then the sampled rows. Returns model seconds. `grammars`: the
        constrained sequences it (re)admits (agent/grammar.py); `histories`: the tokens before rows
        admitted past position 0 (SequenceState.start_histories)."""
        self.seqs.free(free)
        self.seqs.start_grammars(grammars or [])
        self.seqs.start_histories(histories or [])
        x = v.inputs
        if x.query_lens.shape[0] == 0:  # nothing to compute (a `free`-only step, or an IPC probe)
            return 0.0
        starts = row_starts(x.query_lens, x.tokens.shape[0])
        tokens, unfed = self.seqs.feed(x, starts)
        self.seqs.track(x, tokens, v.sampling, starts)
        drafted, first = None, None
        if x.spec_len.any():  # drafts in, their empty slots out (each row's draft slots start at `first`)
            drafted, first = self.seqs.draft(x, tokens, starts, unfed), np.cumsum(x.spec_len) - x.spec_len
            x, tokens = without_unfilled(x, tokens, starts, drafted)
            starts = row_starts(x.query_lens, x.tokens.shape[0])
        t0 = time.perf_counter()
        logits, lse = self.forward(x, tokens)
        elapsed = time.perf_counter() - t0
        writes = self.rc.tp.rank == 0  # every rank samples alike (the same logits and seed); rank 0 writes
        rows = sampled_rows(x.sample)
        if writes:  # from the logits as the model gave them: penalties and masks change them in place
            self._score_and_dump(v, x, tokens, starts, logits, lse, rows)
        if drafted is not None:
            self._verify(v, x, tokens, starts, logits, lse, unfed, first, writes)
        elif x.sample.any():
            res = self._sample(v, logits[rows], lse[rows], rows, unfed)
            if writes:
                write_samples(v.outputs, rows, res)
                v.outputs.drafted[:] = v.outputs.accepted[:] = 0
        return elapsed

    def _verify(self, v: StepView, x: StepInputs, tokens: np.ndarray, starts: np.ndarray, logits: np.ndarray,
                lse: np.ndarray, unfed: np.ndarray, first: np.ndarray, writes: bool) -> None:
        """A step with drafts (`x`: its filled draft slots only): every sampled row sampled position
        by position while its drafts hold (agent/spec/verify.py); the kept drafts join the
        sequences' histories."""
        rows = np.nonzero(x.sample)[0]
        spec = x.spec_len[rows]
        head = heads(logit_positions(x, starts), x.tokens.shape[0], (starts + x.query_lens - 1)[rows], spec)
        width = int(spec.max(initial=0))
        slot = starts[rows, None] + 1 + np.arange(width)[None, :]
        drafts = np.where(np.arange(width)[None, :] < spec[:, None], tokens[np.minimum(slot, tokens.size - 1)], -1)
        n_top = int(v.sampling.n_logprobs[rows].max(initial=0))

        def sample_pass(lg: np.ndarray, ls: np.ndarray, at: np.ndarray, j: int) -> StepOutputs:
            return self._sample(v, lg, ls, at, unfed if j == 0 else np.zeros_like(unfed), offset=j)

        def kept_fn(at: np.ndarray, ids: np.ndarray) -> None:
            for r, t in zip(at.tolist(), ids.tolist()):
                self.seqs.accept(int(x.seq_ids[r]), [t])

        final, accepted, kept = verify(sample_pass, kept_fn, logits, lse, rows, head, drafts, spec, n_top)
        if writes:
            write_samples(v.outputs, rows, final)
            v.outputs.drafted[:], v.outputs.accepted[:] = x.spec_len, 0
            v.outputs.accepted[rows] = accepted
            write_drafts(v.drafts, first[rows], accepted, kept)

    def _score_and_dump(self, v: StepView, x: StepInputs, tokens: np.ndarray, starts: np.ndarray,
                        logits: np.ndarray, lse: np.ndarray, rows: slice | np.ndarray) -> None:
        """Prompt logprobs, and the contest's precision files (--dump-logits)."""
        if v.scores.score_logprobs.size:
            score(x, v.sampling, starts, logit_positions(x, starts), logits, lse, v.scores)
        if self.seqs.dump is not None:
            self.seqs.write_dump(x, tokens, starts, logits[rows], rows)

    def _sample(self, v: StepView, logits: np.ndarray, lse: np.ndarray, rows: slice | np.ndarray,
                unfed: np.ndarray, offset: int = 0) -> StepOutputs:
        """The sampled rows' tokens under their grammars' masks; a row whose input was unknown or whose
        grammar is in error gets -1 (it fails, its neighbours go on). `offset`: the position within
        rows being verified (their output so far is that many tokens longer)."""
        seq_ids = v.inputs.seq_ids[rows]
        hist = [self.seqs.history(int(s)) for s in seq_ids]
        g = self.seqs.grammars
        constrained = g.constrained(seq_ids) if g is not None else []
        failed = g.mask(logits, constrained) if constrained else None
        cols = v.sampling.take(rows)
        if offset:
            cols.output_len = cols.output_len + offset
        res = sample(logits, lse, cols, hist, self.rng)
        res.ids[unfed[rows]] = -1
        if constrained:
            res.ids[failed] = -1
            g.consume(constrained, res.ids)
        self.seqs.sampled(seq_ids, res.ids)
        return res

    def load_adapter(self, slot: int, adapter: Any) -> None:
        """LoRA: `adapter` (agent.lora.peft.Adapter; None: empty the slot) into slot `slot`, between
        steps: rows with `adapter` slot + 1 run with it from the next step on."""
        if self.lora is None or not 0 <= slot < self.lora.slots:
            raise ValueError(f"LoRA slot {slot}: this model has {self.lora_slots} (serving_config.max_loras)")
        if adapter is not None and adapter.rank > self.lora.rank:
            raise ValueError(f"LoRA adapter {adapter.name}: rank {adapter.rank} is over max_lora_rank {self.lora.rank}")
        write_slot(self.model, self.lora, slot, shard_adapter(adapter, self.cfg, self.rc.tp))

    def reset(self) -> None:
        self.seqs.reset()

    def warmup(self, freeze: bool = True) -> None:
        """Build every graph a step can run (one per token bucket) before traffic, in a fixed order:
        a compile under traffic stalls its step for seconds. Graphs load from the on-disk cache when
        it is warm; none is ever built after this. Where the model skips a step's padding (the stack
        op), each graph also runs once, all padding (one token computed): MindSpore allocates a
        graph's buffers at its first run, and under traffic those first runs grew the agent for
        minutes after ready (issue 68, docs/perf-notes.md)."""
        shapes = self.rc.graph_shapes()
        start = time.monotonic()
        for i, (t, r, s) in enumerate(shapes, 1):
            t0 = time.monotonic()
            z = np.zeros(t, np.int32)
            args = (z, z, z, np.full(t, r - 1, np.int32), np.zeros((r, self.rc.width), np.int32), np.zeros(s, np.int32))
            self._run(*args, compile_only=True)
            if self.model.one_op_stack:
                self._run(*args)
                self.warmed.add((t, r, s))
            log.debug("graph %d/%d (%d tokens, %d rows, %d sampled) %.1fs", i, len(shapes), t, r, s,
                      time.monotonic() - t0)
            if i == len(shapes) // 2:  # progress in one line (each graph's own at DEBUG)
                log.info("building graphs: %d/%d (up to %d tokens) in %.1fs", i, len(shapes), t,
                         time.monotonic() - start)
        if self.draft is not None:  # its graphs next, in the same fixed order (the compile-cache key names it)
            self.draft.warmup(freeze=False)
        if freeze:
            freeze_compile_cache()


def sampled_rows(sample: np.ndarray) -> slice | np.ndarray:
    """The rows that sample: where every row does (decode steps) a slice, so the logits are views, not
    copies (docs/perf-notes.md)."""
    sampled = np.nonzero(sample)[0]
    return slice(0, sampled.size) if sampled.size == sample.shape[0] else sampled


def write_samples(out: StepOutputs, rows: slice | np.ndarray, res: StepOutputs) -> None:
    """The sampled tokens, their logprobs and top alternatives into the arena's outputs."""
    out.ids[rows] = res.ids
    out.logprobs[rows] = res.logprobs
    n = res.top_ids.shape[1]
    out.top_ids[rows, :n] = res.top_ids
    out.top_logprobs[rows, :n] = res.top_logprobs
