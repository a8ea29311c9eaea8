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
from agent.model.lora import LoraSlots
from agent.packing import GraphInputs, pack, padding
from agent.runner_config import RunnerConfig, logit_positions, row_starts
from agent.grammar import Grammars
from agent.sampling import score, write_samples
from agent.sequences import SequenceState
from agent.speculative.proposer import Proposer
from agent.speculative.speculator import Speculator
from agent.speculative.verify import without_unfilled
from agent.tensor_parallel import shard, shard_adapter
from common.memory import kv_dtype_for
from shm.step import StepInputs, StepView

log = logging.getLogger("llm_serving.agent")


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, Any], rc: RunnerConfig, seed: int = 0,
                 calibration: list[int] | None = None, grammar_tokenizer: Any = None, proposer: Proposer | None = None,
                 lora: LoraSlots | None = None):
        """`calibration`: token ids of agent.model.calibrate.CALIBRATION_TEXT (int8 smoothing);
        `grammar_tokenizer`: common.grammar.ll_tokenizer's, for constrained decoding; `proposer`:
        what drafts the rows that ask for drafts (agent/speculative/), else they get none; `lora`: the
        LoRA adapters' slots (agent.model.lora.LoraSlots), which rows pick by their `adapter`."""
        if rc.max_model_len > model_cfg.max_position:
            model_cfg.max_position = rc.max_model_len
        self.cfg, self.rc = model_cfg, rc
        self.lib = lib = kernels.library() if rc.native_kernels else None
        self.native_kernels = lib is not None
        # the kernels' batch invariance is one setting per process: set before each graph call
        self.deterministic_switch = kernels.deterministic_switch(lib) if lib is not None else None
        self.model = build_model(model_cfg, weights, rc, lib, calibration, lora)
        self.kv_dtype = self.model.kv_dtype
        self.kernel_paths = kernels.kernel_paths(lib, rc.model_dtype, rc.int8_group, rc.deterministic)
        if types := self.model.block_types():  # gguf: which block types run so
            self.kernel_paths += f" ({types})"
        self.graph = GraphCall(self.model)
        self.lora = lora
        self.seqs = SequenceState(seed)
        self.speculator: Speculator | None = None
        self.use_proposer(proposer)
        self.writes = rc.tp.rank == 0  # every rank samples alike (the same logits and seed); rank 0 writes
        if grammar_tokenizer is not None:
            self.seqs.grammars = Grammars(grammar_tokenizer, model_cfg.vocab_size, lib)
        self.compiled: set[tuple[int, int, int]] = set()  # graph shapes built in this process
        self.warmed: set[tuple[int, int, int]] = set()  # graph shapes warm-up ran (their buffers exist)

    def use_proposer(self, proposer: Proposer | None) -> None:
        """Rows that ask for drafts get `proposer`'s (None: none); between steps only."""
        self.seqs.proposer = proposer
        self.speculator = Speculator(proposer, self.seqs) if proposer is not None else None

    @property
    def graph_compiles(self) -> int:
        return len(self.compiled) + (self.speculator.proposer.graph_compiles() if self.speculator else 0)

    def _run(self, g: GraphInputs, compile_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One graph call (`compile_only`: build or load its graph without running it, faster than a first run)."""
        from mindspore import Tensor

        self.compiled.add(g.shape)
        if self.deterministic_switch is not None:
            self.deterministic_switch(int(self.rc.deterministic))
        arrays = list(g[:6]) + ([self.lora.mask(g.adapters, g.tokens.shape[0])] if self.lora is not None else [])
        # Wrapped, not copied: the arrays are this call's own (docs/perf-notes.md).
        args = [Tensor.from_numpy(a) for a in arrays]
        if compile_only:
            self.graph.compile(*args)
            return np.empty(0), np.empty(0)
        logits, lse = self.graph(*args)
        return logits.asnumpy(), lse.asnumpy()

    def forward(self, x: StepInputs, fed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Logits [P, vocab] and log-sum-exp [P] at the `logit_positions` (the last query token of
        every row first), from one graph call over the packed tokens of all rows (`fed`: the tokens
        with fed rows filled in)."""
        g, n = pack(x, fed, self.rc)
        logits, lse = self._run(g)
        return logits[:n], lse[:n]

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
        if x.spec_len.any():
            if self.speculator is not None:
                return self.speculator.step(self, v, x, tokens, starts, unfed)
            x, tokens = without_unfilled(x, tokens, starts, np.zeros_like(x.spec_len))  # no proposer (--dump-logits)
            starts = row_starts(x.query_lens, x.tokens.shape[0])
        logits, lse, elapsed = self.logits(v, x, tokens, starts)
        if x.sample.any():
            rows = sampled_rows(x.sample)
            res = self.seqs.sample(v, logits[rows], lse[rows], rows, unfed)
            if self.writes:
                write_samples(v.outputs, rows, res)
                v.outputs.drafted[:] = v.outputs.accepted[:] = 0
        return elapsed

    def logits(self, v: StepView, x: StepInputs, tokens: np.ndarray,
               starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """The step's forward (logits, log-sum-exp, model seconds); where this rank writes, prompt
        logprobs and the contest's precision files (--dump-logits) from the logits as the model gave
        them (penalties and masks change them in place later)."""
        t0 = time.perf_counter()
        logits, lse = self.forward(x, tokens)
        elapsed = time.perf_counter() - t0
        if self.writes and v.scores.score_logprobs.size:
            score(x, v.sampling, starts, logit_positions(x, starts), logits, lse, v.scores)
        if self.writes and self.seqs.dump is not None:
            rows = sampled_rows(x.sample)
            self.seqs.write_dump(x, tokens, starts, logits[rows], rows)
        return logits, lse, elapsed

    def load_adapter(self, slot: int, adapter: Any) -> None:
        """LoRA: `adapter` into slot `slot`, between steps (agent.model.lora.LoraSlots.load)."""
        if self.lora is None:
            raise ValueError(f"LoRA slot {slot}: this model has 0 (serving_config.max_loras)")
        self.lora.load(self.model, slot, adapter)

    def reset(self) -> None:
        self.seqs.reset()

    def warmup(self, freeze: bool = True) -> None:
        """Build every graph a step can run before traffic, in a fixed order (a compile under traffic
        stalls its step for seconds; the on-disk cache serves a warm start). Where the model skips
        padding (the stack op) each also runs once, all padding: MindSpore allocates a graph's
        buffers at its first run (issue 68, docs/perf-notes.md)."""
        shapes = self.rc.graph_shapes()
        start = time.monotonic()
        for i, (t, r, s) in enumerate(shapes, 1):
            t0 = time.monotonic()
            g = padding(t, r, s, self.rc.width)
            self._run(g, compile_only=True)
            if self.model.one_op_stack:
                self._run(g)
                self.warmed.add((t, r, s))
            log.debug("graph %d/%d (%d tokens, %d rows, %d sampled) %.1fs", i, len(shapes), t, r, s,
                      time.monotonic() - t0)
            if i == len(shapes) // 2:  # progress in one line (each graph's own at DEBUG)
                log.info("building graphs: %d/%d (up to %d tokens) in %.1fs", i, len(shapes), t,
                         time.monotonic() - start)
        if self.speculator is not None:
            self.speculator.proposer.warmup()
        if freeze:
            freeze_compile_cache()


def build_model(model_cfg: ModelConfig, weights: dict[str, Any], rc: RunnerConfig, lib: Any,
                calibration: list[int] | None, lora: LoraSlots | None) -> DecoderModel:
    """This rank's share of the model on its backend (dtype, kernels, KV dtype, int8 smoothing, LoRA slots)."""
    if rc.deterministic and lib is None:
        raise ValueError("serving_config.deterministic needs the native kernels (a C++ compiler, LLM_SERVING_NATIVE not "
                         "0, a CPU device): the plain-MindSpore path's MatMuls sum in an order that follows the row count")
    if rc.lora != ((lora.slots, lora.rank) if lora else (0, 0)):  # the compile-cache key names rc's
        raise ValueError(f"RunnerConfig.lora {rc.lora}: the model's LoRA slots and rank differ")
    if lora is not None:  # tensor parallel: each adapter split as its base projections are
        lora.for_rank(lambda adapter: shard_adapter(adapter, model_cfg, rc.tp))
    int8 = rc.model_dtype == "int8"
    ranges = activation_ranges(model_cfg, weights, calibration) if int8 and calibration else None
    backend = Backend(rc.model_dtype, lib, kv_dtype_for(rc.kv_cache_dtype, rc.model_dtype, lib is not None),
                      rc.int8_group, ranges, rc.tp.size, lora)
    shard_cfg, weights = shard(model_cfg, weights, rc.tp, lib)  # tensor parallel: this rank's share
    return DecoderModel(shard_cfg, weights, rc.num_blocks * rc.block_size, rc.block_size, backend)


def sampled_rows(sample: np.ndarray) -> slice | np.ndarray:
    """The rows that sample: where every row does (decode steps) a slice, so the logits are views, not
    copies (docs/perf-notes.md)."""
    sampled = np.nonzero(sample)[0]
    return slice(0, sampled.size) if sampled.size == sample.shape[0] else sampled
