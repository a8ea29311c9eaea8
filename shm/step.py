"""The step contract: every arena field declared once, as typed views; the row encoder (server side)
and the output reader beside them.

Field order here is the byte order of the arena and of the tcp tensor frames (docs/protocol.md).
Shapes use the dims "T" (tokens of the step), "R" (rows), "W" (block-table columns), "N" (top
logprobs), "S" (scored tokens: prompt logprobs), "D" (draft tokens: speculative decoding). Adding a sampling knob: one column in `SamplingColumns` (naming the `SamplingParams`
attribute it encodes) and its use in agent/sampling.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np

MAX_TOP_LOGPROBS = 20


def col(dtype: str, *dims: str, param: str | None = None, neutral: Any = None, none: int | None = None,
        optional: bool = False) -> Any:
    """A field of the step arena. `param`: the sampling-parameter attribute it encodes (else the
    row's attribute of the field's own name), `neutral` its value that changes nothing (greedy,
    no penalty); `none`: what a parameter of None is sent as; `optional`: None in a section built
    off the arena (the sampler's results)."""
    meta = {"dtype": np.dtype(dtype), "dims": dims, "param": param, "neutral": neutral, "none": none}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


@dataclass
class StepInputs:
    """What to compute: per token, and per row (one row = one sequence's query tokens)."""
    tokens: np.ndarray = col("int32", "T")
    positions: np.ndarray = col("int32", "T")
    slots: np.ndarray = col("int32", "T")  # KV slot each token is written to: block * block_size + offset
    query_lens: np.ndarray = col("int32", "R")  # tokens of each row; rows are packed in order
    block_tables: np.ndarray = col("int32", "R", "W")
    seq_ids: np.ndarray = col("int64", "R")
    sample: np.ndarray = col("int32", "R")  # 1: sample after the row's last token (decode, or a prompt's last chunk)
    # 1: a decode row whose one query token is the agent's own last sample for seq_ids[r] (its
    # `tokens` entry is ignored): what lets the server send step N+1 before step N's tokens are back.
    feed: np.ndarray = col("int32", "R")
    # -1, or the prompt's next token: this token's logits are scored against it (prompt logprobs;
    # the step's scored tokens write ScoreOutputs in token order).
    targets: np.ndarray = col("int32", "T")
    # Speculative decoding: a fed row may carry this many draft tokens after its fed one (its query is
    # 1 + spec_len tokens; the agent proposes them, agent/speculative/): all are verified in this step.
    spec_len: np.ndarray = col("int32", "R")
    # LoRA: the row's adapter, 0 (the base model) or its slot + 1 on the agent (agent/model/lora.py)
    adapter: np.ndarray = col("int32", "R")


@dataclass
class SamplingColumns:
    """Per-row sampling settings and the row state the sampler needs."""
    prompt_len: np.ndarray = col("int32", "R")  # penalties: repetition over prompt+output, the others over output
    output_len: np.ndarray = col("int32", "R")  # tokens generated so far: seeds a seeded row's per-step stream
    temperature: np.ndarray = col("float32", "R", param="temperature", neutral=0.0)  # 0 = greedy
    top_k: np.ndarray = col("int32", "R", param="top_k", neutral=0)  # 0 = off
    top_p: np.ndarray = col("float32", "R", param="top_p", neutral=1.0)  # 1 = off
    min_p: np.ndarray = col("float32", "R", param="min_p", neutral=0.0)  # 0 = off
    repetition_penalty: np.ndarray = col("float32", "R", param="repetition_penalty", neutral=1.0)  # 1 = off
    presence_penalty: np.ndarray = col("float32", "R", param="presence_penalty", neutral=0.0)
    frequency_penalty: np.ndarray = col("float32", "R", param="frequency_penalty", neutral=0.0)
    seed: np.ndarray = col("int64", "R", param="seed", neutral=None, none=-1)  # -1 = unseeded
    n_logprobs: np.ndarray = col("int32", "R", param="logprobs", neutral=0)  # top alternatives to report, <= N
    # top alternatives of each scored prompt token, <= N (its `targets` say which tokens are scored)
    n_prompt_logprobs: np.ndarray = col("int32", "R", param="prompt_logprobs", neutral=None, none=0)

    @staticmethod
    def greedy() -> SimpleNamespace:
        """Sampling parameters at their neutral values (greedy, no penalties, no logprobs): what a
        client without the server's SamplingParams passes as `RowInput.params`."""
        return SimpleNamespace(**{f.metadata["param"]: f.metadata["neutral"]
                                  for f in fields(SamplingColumns) if f.metadata["param"]})

    def take(self, rows: np.ndarray | slice) -> "SamplingColumns":
        return SamplingColumns(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass
class StepOutputs:
    """What the agent writes back for every row that samples (the sampler returns one for the
    sampled rows, with n <= N alternatives)."""
    ids: np.ndarray = col("int32", "R")  # -1: this row's sampling failed (its neighbours are unaffected)
    logprobs: np.ndarray = col("float32", "R")
    top_ids: np.ndarray = col("int32", "R", "N")
    top_logprobs: np.ndarray = col("float32", "R", "N")
    drafted: np.ndarray = col("int32", "R", optional=True)  # drafts the agent proposed for the row (<= spec_len)
    # drafts accepted (<= drafted): the row emits them (DraftOutputs) and then `ids`
    accepted: np.ndarray = col("int32", "R", optional=True)


@dataclass
class DraftOutputs:
    """Per draft slot of the step (row r's spec_len[r] slots after those of the rows before it): its
    first `accepted[r]` hold the accepted drafts in order, each with its logprob and top alternatives."""
    draft_ids: np.ndarray = col("int32", "D")
    draft_logprobs: np.ndarray = col("float32", "D")
    draft_top_ids: np.ndarray = col("int32", "D", "N")
    draft_top_logprobs: np.ndarray = col("float32", "D", "N")


@dataclass
class ScoreOutputs:
    """Per scored prompt token, in token order: its target's log-probability and the top alternatives."""
    score_logprobs: np.ndarray = col("float32", "S")  # field names are unique across sections (the layout's keys)
    score_top_ids: np.ndarray = col("int32", "S", "N")
    score_top_logprobs: np.ndarray = col("float32", "S", "N")


SECTIONS = (StepInputs, SamplingColumns, StepOutputs, ScoreOutputs, DraftOutputs)
INPUT_SECTIONS = (StepInputs, SamplingColumns)
OUTPUT_SECTIONS = (StepOutputs, ScoreOutputs, DraftOutputs)


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: np.dtype
    dims: tuple[str, ...]


def field_specs(section: type) -> list[FieldSpec]:
    return [FieldSpec(f.name, f.metadata["dtype"], f.metadata["dims"]) for f in fields(section)]


def all_fields(sections: tuple[type, ...] = SECTIONS) -> Iterator[tuple[type, FieldSpec]]:
    for section in sections:
        for spec in field_specs(section):
            yield section, spec


@dataclass
class StepView:
    """Numpy views of one step's live part of an arena (or of its full capacity)."""
    inputs: StepInputs
    sampling: SamplingColumns
    outputs: StepOutputs
    scores: ScoreOutputs
    drafts: DraftOutputs

    def section(self, cls: type) -> Any:
        return {StepInputs: self.inputs, SamplingColumns: self.sampling, StepOutputs: self.outputs,
                ScoreOutputs: self.scores, DraftOutputs: self.drafts}[cls]


def check_params(cls: type) -> type:
    """Class decorator for the server's sampling parameters: every column's `param` must be one of
    its fields, so a misspelt or missing knob fails at import, not at the first step."""
    names = {f.name for f in fields(cls)}
    missing = [f.metadata["param"] for f in fields(SamplingColumns) if f.metadata["param"] not in (None, *names)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks the sampling parameters {missing} the step contract encodes")
    return cls


def check_indices(v: StepView, vocab: int, num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Agent side: every index a step carries lies inside the model and the KV pool, and its scored
    tokens are as many as its header said (else ValueError)."""
    x = v.inputs
    # As unsigned, a negative int32 is >= 2**31 > any bound: one comparison per field (this runs
    # every step, cache-cold after the model's weights went through: docs/perf-notes.md).
    checks = (("tokens", x.tokens, vocab), ("slots", x.slots, num_blocks * block_size),
              ("block_tables", x.block_tables, num_blocks), ("positions", x.positions, max_model_len),
              ("n_logprobs", v.sampling.n_logprobs, MAX_TOP_LOGPROBS + 1), ("feed", x.feed, 2),
              ("n_prompt_logprobs", v.sampling.n_prompt_logprobs, MAX_TOP_LOGPROBS + 1),
              ("targets + 1", x.targets + 1, vocab + 1))
    for name, a, bound in checks:
        if a.size and a.view(np.uint32).max() >= bound:
            raise ValueError(f"{name} out of range [0, {bound})")
    if np.any(x.query_lens[x.feed == 1] != 1 + x.spec_len[x.feed == 1]):
        raise ValueError("a fed row has 1 + spec_len query tokens")
    if np.any((x.spec_len != 0) & ((x.feed != 1) | (x.sample != 1))) or np.any(x.spec_len < 0):
        raise ValueError("only fed, sampling rows carry drafts (spec_len >= 0)")
    if np.count_nonzero(x.targets >= 0) != v.scores.score_logprobs.shape[0]:
        raise ValueError("the step's scored tokens (targets >= 0) are not its n_scored")
    if int(x.spec_len.sum()) != v.drafts.draft_ids.shape[0]:
        raise ValueError("the step's drafts (sum of spec_len) are not its n_drafts")


def check_decode(v: StepView) -> None:
    """Agent side, an `a` step: every row is a decode fed by the agent's own last sample (else ValueError)."""
    if not (np.all(v.inputs.feed == 1) and np.all(v.inputs.sample == 1)):
        raise ValueError("an `a` step has only fed, sampling rows (send rows with tokens as `*`)")


# ------------------------------------------------------------------ server side: encode, read back
@dataclass
class RowInput:
    seq_id: int
    tokens: np.ndarray  # int32 query tokens of this step
    start_pos: int  # position of tokens[0]
    block_table: list[int]
    sample: bool  # sample a token after the last query token
    params: Any  # has the attributes named by SamplingColumns' `param`s (server.sampling_params.SamplingParams)
    prompt_len: int
    output_len: int
    feed: bool = False  # take the query token from the agent's last sample (`tokens` is one placeholder)
    targets: np.ndarray | None = None  # per query token: -1 or the next prompt token it is scored against
    spec: int = 0  # draft tokens the agent proposes after the fed one (`tokens`: 1 + spec placeholders)
    adapter: int = 0  # LoRA adapter slot + 1 (0: the base model)


@dataclass(frozen=True)
class StepDims:
    n_tokens: int
    n_rows: int
    width: int
    n_scored: int = 0  # tokens with targets: ScoreOutputs rows
    n_drafts: int = 0  # draft slots: DraftOutputs rows


def write_rows(view: StepView, rows: list[RowInput], block_size: int) -> None:
    """Encode rows into a full-capacity view (whole-array writes per field, not per row). No rows: a
    step that only frees or exports (a drain) writes nothing."""
    n = len(rows)
    if not n:
        return
    qlens = np.fromiter((len(r.tokens) for r in rows), np.int32, n)
    n_tokens, width = int(qlens.sum()), max(len(r.block_table) for r in rows)
    tables = np.zeros((n, width), np.int32)
    for i, r in enumerate(rows):
        tables[i, :len(r.block_table)] = r.block_table
    # Each row's positions run on from its start.
    row_of = np.repeat(np.arange(n), qlens)
    first = np.cumsum(qlens) - qlens
    pos = (np.fromiter((r.start_pos for r in rows), np.int32, n)[row_of]
           + np.arange(n_tokens, dtype=np.int32) - first[row_of]).astype(np.int32)
    x = view.inputs
    x.tokens[:n_tokens] = np.concatenate([r.tokens for r in rows])
    x.positions[:n_tokens] = pos
    x.slots[:n_tokens] = tables[row_of, pos // block_size] * block_size + pos % block_size
    x.query_lens[:n] = qlens
    x.block_tables[:n, :width] = tables
    x.seq_ids[:n] = [r.seq_id for r in rows]
    x.sample[:n] = [int(r.sample) for r in rows]
    x.feed[:n] = [int(r.feed) for r in rows]
    x.spec_len[:n] = [r.spec for r in rows]
    x.adapter[:n] = [r.adapter for r in rows]
    x.targets[:n_tokens] = np.concatenate([np.full(len(r.tokens), -1, np.int32) if r.targets is None else r.targets
                                           for r in rows])
    for f in fields(SamplingColumns):
        param, none = f.metadata["param"], f.metadata["none"]
        values = ([getattr(r, f.name) for r in rows] if param is None else
                  [none if getattr(r.params, param) is None else getattr(r.params, param) for r in rows])
        getattr(view.sampling, f.name)[:n] = values


def step_dims(rows: list[RowInput]) -> StepDims:
    return StepDims(sum(len(r.tokens) for r in rows), len(rows), max((len(r.block_table) for r in rows), default=0),
                    sum(int(np.count_nonzero(r.targets >= 0)) for r in rows if r.targets is not None),
                    sum(r.spec for r in rows))


@dataclass(frozen=True)
class RowOutput:
    token: int  # -1: sampling failed for this row
    logprob: float
    top: list[tuple[int, float]]


def read_row(out: StepOutputs, row: int, n_top: int) -> RowOutput:
    top = list(zip(out.top_ids[row, :n_top].tolist(), out.top_logprobs[row, :n_top].tolist()))
    return RowOutput(int(out.ids[row]), float(out.logprobs[row]), top)


def read_drafts(out: DraftOutputs, first: int, n: int, n_top: int) -> list[RowOutput]:
    """A row's `n` accepted drafts, its draft slots starting at `first`."""
    k = slice(first, first + n)
    ids, lps = out.draft_ids[k].tolist(), out.draft_logprobs[k].tolist()
    tops, tlps = out.draft_top_ids[k, :n_top].tolist(), out.draft_top_logprobs[k, :n_top].tolist()
    return [RowOutput(t, lp, list(zip(i, tl))) for t, lp, i, tl in zip(ids, lps, tops, tlps)]


def read_scores(out: ScoreOutputs, first: int, targets: list[int], n_top: int) -> list[RowOutput]:
    """The scores of consecutive scored tokens from index `first`, with their targets."""
    k = slice(first, first + len(targets))
    lps, ids, tops = out.score_logprobs[k].tolist(), out.score_top_ids[k, :n_top].tolist(), \
        out.score_top_logprobs[k, :n_top].tolist()
    return [RowOutput(t, lp, list(zip(i, tl))) for t, lp, i, tl in zip(targets, lps, ids, tops)]
